"""SmolVLM2 (``SmolVLMForConditionalGeneration``) with videos against HF transformers on a
tiny random checkpoint.

The checkpoint is tests/fixtures_idefics3.py's SmolVLM one (56-pixel tiles, 4 rows a tile)
with ``<video>`` added to its tokenizer, a chat template that writes a video part as
``<video>``, and a ``video_preprocessor_config.json`` (frames to 56 pixels). HF's video
processor needs torchvision and its processor ``num2words`` (neither installed here), so
the reference is built from the parts that run: the fused rescale-and-normalize of
unresized frames, ``SmolVLMProcessor.replace_video_token`` for the prompt text (with
chassis' number words, themselves checked against ``num2words``' spellings), and the video
processor's settings as ``SmolVLMVideoProcessor.from_pretrained`` reads them. Checked,
float32: pixels and the expanded prompt for bare frames, a loaded video's metadata and the
request's ``fps``; prefill logits against HF's forward for a video and for an image beside
a video; ``LLM.generate`` greedy tokens and logprobs against HF ``generate``, with chunked
prefill through the run and a prefix-cache hit; a chat ``video_url`` part (an MP4 encoded
losslessly with PyAV); bad videos and too many videos are clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_idefics3 import CHAT_TEMPLATE, IMAGE_TOKEN_ID, hf_model, save_tiny_idefics3
from fixtures_llava import random_image
from mm_hf_compare import (
    PARAMS,
    answers,
    answers_and_cached,
    assert_prefill_and_decode_match,
    hf_generate,
    small_llm,
)
from test_models_parity import Runner

from chassis import SamplingParams
from chassis.builtin_plugins.models.smolvlm import SmolVLMForConditionalGenerationWithImages
from chassis.builtin_plugins.models.smolvlm_media import SmolVLMMediaInputs
from chassis.builtin_plugins.models.smolvlm_video import number_words
from chassis.core.multimodal import MultiModalFeature

VIDEO_CONFIG = {
    "size": {"longest_edge": 56},
    "max_image_size": {"longest_edge": 56},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 1,
    "video_sampling": {"fps": 1, "max_frames": 8, "video_size": {"longest_edge": 112}},
    "processor_class": "SmolVLMProcessor",
    "video_processor_type": "SmolVLMVideoProcessor",
}
#: the fixture's template with video parts
VIDEO_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif p.type == 'text' %}",
    "{% elif p.type in ['video', 'video_url'] %}<video>{% elif p.type == 'text' %}",
)
#: (frames, metadata) of clips that need no resize
CLIPS = {
    "bare": (3, None),
    "loaded": (4, {"fps": 2.0, "frames_indices": [0, 50, 100, 150], "duration": 90.5}),
    "fps_only": (2, {"fps": 0.25}),
}


def chat(text: str, media: str = "<video>") -> str:
    return f"<|im_start|>User:{media} {text}<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf

    d = save_tiny_idefics3(tmp_path_factory.mktemp("smolvlm2"), smolvlm=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(d)
    tokenizer.add_tokens(["<video>"], special_tokens=True)
    tokenizer.chat_template = VIDEO_CHAT_TEMPLATE
    tokenizer.save_pretrained(d)
    (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return d


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return hf_model(model_dir, smolvlm=True)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> Runner:
    return Runner(model_dir)


@pytest.fixture(scope="module")
def processor(model_dir: Path, runner: Runner) -> SmolVLMMediaInputs:
    return SmolVLMMediaInputs.from_pretrained(model_dir, runner.hf_config)


@pytest.fixture(scope="module")
def hf_processor(model_dir: Path) -> Any:
    """``SmolVLMProcessor`` with the attributes ``replace_video_token`` reads set directly
    (its constructor wants num2words; its module's ``num2words`` is chassis' here)."""
    import transformers as tf
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    processor = tf.SmolVLMProcessor.__new__(tf.SmolVLMProcessor)
    processor.tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    processor.video_processor = SmolVLMVideoProcessor.from_pretrained(model_dir)
    processor.image_seq_len = 4
    processor.image_token, processor.video_token = "<image>", "<video>"
    processor.fake_image_token = "<fake_token_around_image>"
    processor.global_image_token = "<global-img>"
    processing_smolvlm.num2words = number_words
    return processor


def random_video(frames: int, height: int = 56, width: int = 56, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def item_of(video: np.ndarray, metadata: dict[str, Any] | None) -> Any:
    return video if metadata is None else (video, metadata)


def hf_prompt_ids(
    hf_processor: Any, prompt: str, count: int, metadata: dict[str, Any] | None
) -> list[int]:
    """HF's expanded prompt (transformers' default metadata for bare frames)."""
    from transformers.video_utils import VideoMetadata

    meta = {"total_num_frames": count, "fps": None, "frames_indices": list(range(count))}
    meta.update(metadata or {})
    inputs = {"pixel_values": torch.zeros(1, count), "video_metadata": [VideoMetadata(**meta)]}
    text = prompt.replace("<video>", hf_processor.replace_video_token(inputs, 0))
    return hf_processor.tokenizer(text).input_ids


def hf_pixels(video: np.ndarray) -> torch.Tensor:
    """HF's fused rescale and normalize of frames that need no resize: ``[T, 3, H, W]``."""
    frames = torch.from_numpy(video).permute(0, 3, 1, 2).float()
    return (frames - 0.5 * 255) / (0.5 * 255)


def process(
    processor: SmolVLMMediaInputs, prompt: str, items: dict[str, list[Any]], **kwargs: Any
) -> tuple[list[int], list[MultiModalFeature]]:
    ids = processor.tokenizer(prompt).input_ids
    return processor.process(ids, items, kwargs)


def hf_inputs_of(ids: list[int], features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
    """HF's model inputs for our expanded prompt: every tile and frame in prompt order."""
    tiles = [feature.tensors()["pixel_values"] for feature in features]
    out = {"input_ids": torch.tensor([ids])}
    if tiles:
        out["pixel_values"] = torch.cat(tiles)[None]
    return out


# -- the processor ---------------------------------------------------------------------------


def test_number_words_are_num2words_spellings() -> None:
    spelled = {
        0: "zero",
        13: "thirteen",
        21: "twenty-one",
        64: "sixty-four",
        100: "one hundred",
        101: "one hundred and one",
        1100: "one thousand, one hundred",
        12005: "twelve thousand and five",
        2345: "two thousand, three hundred and forty-five",
    }
    assert {n: number_words(n) for n in spelled} == spelled


def test_settings_are_the_hf_video_processors(
    processor: SmolVLMMediaInputs, hf_processor: Any
) -> None:
    """``size`` wins over ``video_sampling.video_size``, as in transformers."""
    vp = hf_processor.video_processor
    frames = processor.frames
    assert frames.longest_edge == vp.size["longest_edge"] == 56
    assert frames.tile == vp.max_image_size["longest_edge"] and not frames.split
    assert frames.steps.mean == tuple(vp.image_mean) and frames.steps.std == tuple(vp.image_std)


@pytest.mark.parametrize("clip", list(CLIPS))
def test_pixels_and_prompt_match_the_hf_processor(
    processor: SmolVLMMediaInputs, hf_processor: Any, clip: str
) -> None:
    count, metadata = CLIPS[clip]
    video = random_video(count, seed=count)
    prompt = chat("What happens?")
    ids, [feature] = process(processor, prompt, {"video": [item_of(video, metadata)]})
    tensors = feature.tensors()
    torch.testing.assert_close(tensors["pixel_values"], hf_pixels(video), atol=1e-5, rtol=0)
    assert ids == hf_prompt_ids(hf_processor, prompt, count, metadata)
    run = ids[feature.offset : feature.end]
    assert run == tensors["placeholder_ids"].tolist()
    assert run.count(IMAGE_TOKEN_ID) == count * 4
    text = processor.tokenizer.decode(run)
    if clip == "loaded":  # frame 150 at 2 fps: 01:15 of a 0:01:30 video
        assert "four frames from a 0:01:30" in text and "Frame from 01:15:" in text


def test_frames_of_other_sizes_and_pil_frames(processor: SmolVLMMediaInputs) -> None:
    """Frames of any size become one 56-pixel tile each; PIL frames are one video; the
    request's ``fps`` times raw frames as metadata would."""
    from PIL import Image

    for height, width in ((40, 90), (120, 30), (20, 20)):
        _, [feature] = process(processor, chat("x"), {"video": [random_video(3, height, width)]})
        assert feature.tensors()["pixel_values"].shape == (3, 3, 56, 56)
    video = random_video(3, seed=9)
    a = process(processor, chat("x"), {"video": [[Image.fromarray(f) for f in video]]}, fps=0.5)
    b = process(processor, chat("x"), {"video": [(video, {"fps": 0.5})]})
    assert a[0] == b[0] and a[1][0].identifier == b[1][0].identifier
    assert process(processor, chat("x"), {"video": [video]})[0] != a[0]


def test_bad_videos_are_clear_errors(processor: SmolVLMMediaInputs) -> None:
    cases = [
        ((random_video(3), {"fps": 2, "frames_indices": [0, 1]}), "one per frame"),
        ((random_video(2), {"fps": -1}), "number > 0"),
        (np.zeros((2, 56, 56), dtype=np.uint8), r"\[frames, height, width, 3\]"),
        ([], "non-empty list of PIL"),
    ]
    for video, match in cases:
        with pytest.raises(ValueError, match=match):
            process(processor, chat("x"), {"video": [video]})
    with pytest.raises(ValueError, match="fps must be a number > 0"):
        process(processor, chat("x"), {"video": [random_video(2)]}, fps=0)
    with pytest.raises(ValueError, match="num_frames not supported"):
        process(processor, chat("x"), {"video": [random_video(2)]}, num_frames=2)


# -- the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["video", "image_and_video"])
def test_prefill_and_decode_logits_match_transformers(
    runner: Runner, processor: SmolVLMMediaInputs, hf: Any, case: str
) -> None:
    video = (random_video(3, seed=1), {"fps": 1.0, "frames_indices": [0, 1, 2]})
    items: dict[str, list[Any]] = {"video": [video]}
    prompt = chat("Describe the clip.")
    if case == "image_and_video":
        prompt = chat("Compare.", "<image> then<video>")
        items["image"] = [random_image(60, 130, seed=2)]
    ids, features = process(processor, prompt, items)
    assert SmolVLMForConditionalGenerationWithImages.supported_modalities == {"image", "video"}
    assert_prefill_and_decode_match(runner, hf, hf_inputs_of(ids, features), features)


# -- through the engine ----------------------------------------------------------------------


def test_llm_generate_with_videos_matches_hf_generate(
    model_dir: Path, processor: SmolVLMMediaInputs, hf: Any
) -> None:
    """A video, a loaded video, and text in one batch; then the first again with steps of 8
    tokens cutting through its run (encoded once), and once more from the prefix cache."""
    loaded = (random_video(2, seed=5), {"fps": 2, "frames_indices": [0, 3], "duration": 2.0})
    cases = [
        (chat("What happens?"), {"video": [random_video(3, seed=4)]}),
        (chat("And here?"), {"video": [loaded]}),
        (chat("No media.", ""), {}),
    ]
    prompts = [{"prompt": p, "multi_modal_data": m} if m else p for p, m in cases]
    llm = small_llm(model_dir)
    try:
        got = answers(llm.generate(prompts, PARAMS))
    finally:
        llm.shutdown()
    for (prompt, items), answer in zip(cases, got, strict=True):
        ids, features = process(processor, prompt, items)
        answer.assert_matches(hf_generate(hf, hf_inputs_of(ids, features)), prompt)
    llm = small_llm(model_dir, block_size=4, max_num_batched_tokens=8)
    try:
        [chunked] = answers(llm.generate([prompts[0]], PARAMS))
        assert llm.engine.executor.worker.runner.mm.num_encoder_runs == 1
        [(again, cached)] = answers_and_cached(llm.generate([prompts[0]], PARAMS))
    finally:
        llm.shutdown()
    assert chunked.tokens == got[0].tokens
    np.testing.assert_allclose(chunked.logprobs, got[0].logprobs, atol=1e-4)
    assert cached > 0
    again.assert_matches(got[0], "prefix-cache hit")


def test_chat_with_a_video_url(model_dir: Path, processor: SmolVLMMediaInputs, hf: Any) -> None:
    """``LLM.chat`` with a ``video_url`` part (an MP4 data URL, 6 frames at 2 fps, all kept):
    the chat template's prompt, the video's timing in the run, HF's answer."""
    pytest.importorskip("av")
    from test_video_urls import data_url, encode_video

    from chassis.core.video_loading import decode_video

    mp4 = encode_video(random_video(6, seed=8), fps=2)
    content = [
        {"type": "video_url", "video_url": {"url": data_url(mp4)}},
        {"type": "text", "text": "What happens?"},
    ]
    llm = small_llm(model_dir)
    try:
        [output] = llm.chat([{"role": "user", "content": content}], PARAMS)
    finally:
        llm.shutdown()
    assert output.prompt == chat("What happens?")
    ids, features = process(processor, chat("What happens?"), {"video": [decode_video(mp4, "t")]})
    assert list(output.prompt_token_ids) == ids
    assert "six frames from a 0:00:03" in processor.tokenizer.decode(ids)
    [answer] = answers([output])
    answer.assert_matches(hf_generate(hf, hf_inputs_of(ids, features)), "chat")


def test_the_video_limit(model_dir: Path) -> None:
    llm = small_llm(model_dir, limit_mm_per_prompt={"video": 1})
    video = random_video(2)
    try:
        with pytest.raises(ValueError, match=r"At most 1 video\(s\)"):
            llm.generate(
                {
                    "prompt": chat("x", "<video><video>"),
                    "multi_modal_data": {"video": [video, video]},
                }
            )
        (out,) = llm.generate(
            {"prompt": chat("x"), "multi_modal_data": {"video": video}},
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
