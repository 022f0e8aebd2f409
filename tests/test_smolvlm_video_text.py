"""SmolVLM2 videos placed as ``SmolVLMProcessor`` places them: ``<video>`` replaced by the
run's text before tokenizing (builtin_plugins/models/smolvlm_prompt.py).

The run's edges are plain text, so they are tokenized with the prompt text next to them:
with ``User: <video>Describe`` (what ``SmolVLMProcessor``'s video chat template writes)
the tokens are ``ĠYou`` and two ``Ċ``, not ``Ġ`` + ``You`` and ``ĊĊ``. Checked against HF's
text replacement (the reference of tests/test_smolvlm_video.py) for that form, two videos
in a row, an image beside a video, and a tokenizer without ``<video>`` as one token (the
text form), whose ``LLM.generate`` answer is HF ``generate``'s.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_idefics3 import IMAGE_TOKEN_ID, hf_model, save_tiny_idefics3
from fixtures_llava import random_image
from mm_hf_compare import PARAMS, answers, hf_generate, small_llm
from test_models_parity import Runner
from test_smolvlm_video import VIDEO_CHAT_TEMPLATE, VIDEO_CONFIG, hf_inputs_of, random_video

from chassis.builtin_plugins.models.smolvlm_media import SmolVLMMediaInputs
from chassis.builtin_plugins.models.smolvlm_video import number_words
from chassis.core.multimodal import MultiModalFeature

#: ``SmolVLMProcessor``'s video chat template's text for a video first in a message
HF_TEMPLATE = "<|im_start|>User: <video>{}<end_of_utterance>\nAssistant:"


def checkpoint(directory: Path, video_token: bool) -> Path:
    """The tiny SmolVLM checkpoint with a video config, ``<video>`` one token or not."""
    import transformers as tf

    d = save_tiny_idefics3(directory, smolvlm=True)
    if video_token:
        tokenizer = tf.AutoTokenizer.from_pretrained(d)
        tokenizer.add_tokens(["<video>"], special_tokens=True)
        tokenizer.chat_template = VIDEO_CHAT_TEMPLATE
        tokenizer.save_pretrained(d)
    (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return d


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("smolvlm2_token"), video_token=True)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("smolvlm2_text"), video_token=False)


def processor_of(model_dir: Path) -> SmolVLMMediaInputs:
    return SmolVLMMediaInputs.from_pretrained(model_dir, Runner(model_dir).hf_config)


def process(
    processor: SmolVLMMediaInputs, prompt: str, items: dict[str, list[Any]]
) -> tuple[list[int], list[MultiModalFeature]]:
    return processor.process(processor.tokenizer(prompt).input_ids, items, {})


def hf_ids(model_dir: Path, prompt: str, counts: list[int], image_text: str = "") -> list[int]:
    """HF's prompt: each ``<video>`` replaced in turn by ``SmolVLMProcessor``'s text for
    bare frames (``counts[i]`` of them; transformers' default metadata), an ``<image>`` by
    ``image_text``, then tokenized."""
    import transformers as tf
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.video_utils import VideoMetadata

    hf = tf.SmolVLMProcessor.__new__(tf.SmolVLMProcessor)
    hf.tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    hf.image_seq_len = 4
    hf.image_token, hf.video_token = "<image>", "<video>"
    hf.fake_image_token = "<fake_token_around_image>"
    hf.global_image_token = "<global-img>"
    processing_smolvlm.num2words = number_words
    text = prompt.replace("<image>", image_text)
    for count in counts:
        meta = VideoMetadata(total_num_frames=count, fps=None, frames_indices=list(range(count)))
        inputs = {"pixel_values": torch.zeros(1, count), "video_metadata": [meta]}
        text = text.replace("<video>", hf.replace_video_token(inputs, 0), 1)
    return hf.tokenizer(text).input_ids


def check_features(ids: list[int], features: list[MultiModalFeature], frames: list[int]) -> None:
    """Each video feature's run is its placeholder ids, holds its frames' image tokens and
    its intro; the features do not overlap."""
    videos = [f for f in features if f.modality == "video"]
    assert len(videos) == len(frames)
    for feature, count in zip(videos, frames, strict=True):
        run = ids[feature.offset : feature.end]
        assert run == feature.tensors()["placeholder_ids"].tolist()
        assert run.count(IMAGE_TOKEN_ID) == count * 4
    for a, b in pairwise(features):
        assert a.end <= b.offset


@pytest.mark.parametrize(
    "prompt",
    [
        HF_TEMPLATE.format("Describe this video."),
        HF_TEMPLATE.format("<video>Compare the two."),
        "<|im_start|>User: first<video>\n<video>\n\nwhich?<end_of_utterance>\nAssistant:",
    ],
)
def test_runs_are_tokenized_with_their_neighbours_as_hf(token_dir: Path, prompt: str) -> None:
    counts = [3, 2][: prompt.count("<video>")]
    videos = [random_video(n, seed=n) for n in counts]
    ids, features = process(processor_of(token_dir), prompt, {"video": videos})
    assert ids == hf_ids(token_dir, prompt, counts)
    check_features(ids, features, counts)


def test_an_image_beside_a_video(token_dir: Path) -> None:
    prompt = HF_TEMPLATE.format("<image>then the clip.")
    items = {"video": [random_video(2, seed=3)], "image": [random_image(56, 56, seed=1)]}
    processor = processor_of(token_dir)
    ids, features = process(processor, prompt, items)
    # (the image's own text as Idefics3's processor wrote it: tests/test_idefics3_images.py
    # checks it against HF)
    image = next(f for f in features if f.modality == "image")
    image_text = processor.tokenizer.decode(ids[image.offset : image.end])
    assert ids == hf_ids(token_dir, prompt, [2], image_text)
    assert [f.modality for f in features] == ["video", "image"]
    check_features(ids, features, [2])


def test_a_tokenizer_without_the_video_token(text_dir: Path) -> None:
    """The text ``<video>`` is the placeholder; the prompt and ``LLM.generate``'s greedy
    answer are HF's; a count mismatch is a clear error."""
    processor = processor_of(text_dir)
    assert "video" not in processor.placeholder_token_ids
    prompt = HF_TEMPLATE.format("What happens?")
    video = random_video(3, seed=7)
    ids, features = process(processor, prompt, {"video": [video]})
    assert ids == hf_ids(text_dir, prompt, [3])
    check_features(ids, features, [3])
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\) \('<video>'\) but 2"):
        process(processor, prompt, {"video": [video, video]})
    llm = small_llm(text_dir)
    try:
        request = {"prompt": prompt, "multi_modal_data": {"video": video}}
        [got] = answers(llm.generate([request], PARAMS))
    finally:
        llm.shutdown()
    hf = hf_model(text_dir, smolvlm=True)
    got.assert_matches(hf_generate(hf, hf_inputs_of(ids, features)), "text form")
