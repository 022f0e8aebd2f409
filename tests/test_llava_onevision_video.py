"""LLaVA-OneVision with videos against HF transformers on the tiny random checkpoint of
tests/fixtures_llava_onevision.py (28-pixel frames, 4 x 4 features each, pooled to 2 x 2).

HF's video processor needs torchvision, which is not installed here, so our frames are
checked against HF's image processor (the same PIL bicubic resize to ``size``, rescale and
normalization: its base tile of each frame). Then, float32: a video's rows against HF's
``get_video_features`` (pooling, the newline) to 1e-5; the token count against
``LlavaOnevisionProcessor``'s; prefill and decode logits with a video, and with an image and a
video, against HF's forward to 1e-4; greedy tokens and each token's logprob through
``LLM.generate`` against HF ``generate``, chunked prefill through a video equal to one
prefill, and ``LLM.chat`` with a ``video_url`` part (lossless MP4) equal to HF's answer for
its frames; the refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_llava import IMAGE_TOKEN_ID, random_image
from fixtures_llava_onevision import (
    SIDE,
    VIDEO_TOKEN_ID,
    hf_model,
    hf_processor,
    image_processor,
    save_tiny_llava_onevision,
)
from mm_hf_compare import (
    CHUNKED,
    PARAMS,
    answers,
    assert_prefill_and_decode_match,
    checkpoint_fixtures,
    generate_answers,
    hf_generate,
    processor_fixture,
    small_llm,
)
from test_models_parity import Runner

from chassis.builtin_plugins.models.llava_onevision_processing import LlavaOnevisionMediaInputs
from chassis.builtin_plugins.models.llava_onevision_video import VideoFrames
from chassis.core.multimodal import MultiModalFeature

pytest.importorskip("av")

VIDEO_PROMPT = "USER: <video>\nWhat happens? ASSISTANT:"
BOTH = "USER: <image>\nand <video>\nWhat happens? ASSISTANT:"


def random_frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


model_dir, hf, runner = checkpoint_fixtures(save_tiny_llava_onevision, hf_model)
processor = processor_fixture(LlavaOnevisionMediaInputs)


def expand(
    processor: LlavaOnevisionMediaInputs, model_dir: Path, prompt: str, items: dict[str, list]
) -> tuple[list[int], list[MultiModalFeature]]:
    from chassis.core.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, items)


def hf_video_inputs(
    model_dir: Path, prompt: str, video: torch.Tensor, images: list[Any]
) -> dict[str, torch.Tensor]:
    """HF's inputs for ``prompt`` with our ``pixel_values_videos`` (HF's video processor needs
    torchvision): the images through HF's processor, ``<video>`` expanded by its count."""
    processor = hf_processor(model_dir)
    count = processor._get_num_multimodal_tokens(video_sizes=[(video.shape[0], SIDE, SIDE)])
    expanded = prompt.replace("<video>", "<video>" * count["num_video_tokens"][0])
    processor.video_token = None  # (no video given to it: its check would refuse the text)
    out = processor(text=expanded, images=[images] if images else None, return_tensors="pt")
    inputs = {name: value for name, value in out.items() if name != "attention_mask"}
    return {**inputs, "pixel_values_videos": video[None]}


def test_frames_match_the_image_processor() -> None:
    """Each frame equals HF's image processor's resized whole image (the video processor's
    steps, with PIL), for frames smaller, larger and of the tower's size."""
    hf = image_processor()
    ours = VideoFrames.from_dict({"size": {"height": SIDE, "width": SIDE}, **_norm()}, SIDE)
    for shape in ((3, 40, 50), (2, SIDE, SIDE), (2, 13, 90)):
        frames = random_frames(*shape)
        pixels = ours(frames)
        assert pixels.shape == (shape[0], 3, SIDE, SIDE) and pixels.dtype == torch.float32
        for frame, got in zip(frames, pixels, strict=True):
            from PIL import Image

            expected = hf(images=[Image.fromarray(frame)], return_tensors="np")["pixel_values"]
            np.testing.assert_allclose(got.numpy(), expected[0, 0], atol=1e-6, rtol=0)
    pil = [Image.fromarray(frame) for frame in random_frames(2, 40, 50)]
    torch.testing.assert_close(ours(pil), ours(np.stack([np.asarray(p) for p in pil])))


def _norm() -> dict[str, Any]:
    return {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}


def test_video_rows_and_count_match_transformers(
    model_dir: Path, hf: Any, runner: Runner, processor: LlavaOnevisionMediaInputs
) -> None:
    video = random_frames(5, 40, 50)
    ids, [feature] = expand(processor, model_dir, VIDEO_PROMPT, {"video": [video]})
    pixels = feature.tensors()["pixel_values_videos"]
    with torch.no_grad():
        [expected] = hf.model.get_video_features(pixel_values_videos=pixels[None]).pooler_output
        ours = runner.model.embed_multimodal("video", {"pixel_values_videos": pixels})
    count = hf_processor(model_dir)._get_num_multimodal_tokens(video_sizes=[(5, 40, 50)])
    assert feature.length == count["num_video_tokens"][0] == 5 * 4 + 1
    assert ours.shape == expected.shape == (feature.length, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert ids == hf_video_inputs(model_dir, VIDEO_PROMPT, pixels, [])["input_ids"][0].tolist()


@pytest.mark.parametrize("with_image", [False, True])
def test_logits_with_a_video_match_transformers(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: LlavaOnevisionMediaInputs,
    with_image: bool,
) -> None:
    video = random_frames(4, 30, 60, seed=1)
    images = [random_image(60, 90, seed=2)] if with_image else []
    prompt = BOTH if with_image else VIDEO_PROMPT
    items: dict[str, list] = {"video": [video], **({"image": images} if images else {})}
    ids, features = expand(processor, model_dir, prompt, items)
    pixels = next(f for f in features if f.modality == "video").tensors()["pixel_values_videos"]
    inputs = hf_video_inputs(model_dir, prompt, pixels, images)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


def test_generate_chunked_and_chat_match_hf(
    model_dir: Path, hf: Any, processor: LlavaOnevisionMediaInputs
) -> None:
    """``LLM.generate`` with a video (and a video with an image) gives HF's answer; the same
    through 16-token steps cutting the 33-token video; ``LLM.chat`` with the video as an MP4
    ``video_url`` (decoded losslessly) gives HF's answer for its frames."""
    from test_video_urls import data_url, encode_video

    video = random_frames(8, 40, 50, seed=3)
    image = random_image(50, 40, seed=4)
    pixels = VideoFrames.from_pretrained(model_dir, SIDE)(video)
    expected = hf_generate(hf, hf_video_inputs(model_dir, VIDEO_PROMPT, pixels, []))
    expected_both = hf_generate(hf, hf_video_inputs(model_dir, BOTH, pixels, [image]))
    requests = [
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}},
        {"prompt": BOTH, "multi_modal_data": {"video": video, "image": image}},
    ]
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": data_url(encode_video(video))}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    llm = small_llm(model_dir)
    try:
        [one, both] = answers(llm.generate(requests, PARAMS))
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    one.assert_matches(expected, "video")
    both.assert_matches(expected_both, "image and video")
    chatted.assert_matches(expected, "chat video_url")

    [chunked] = generate_answers(model_dir, requests[:1], **CHUNKED, enable_prefix_caching=False)
    chunked.assert_matches(one, "chunked vs unchunked")


def test_bad_videos_are_clear_errors(runner: Runner, processor: LlavaOnevisionMediaInputs) -> None:
    with pytest.raises(ValueError, match="numpy array"):
        processor.process([VIDEO_TOKEN_ID], {"video": ["not a video"]})
    with pytest.raises(ValueError, match="uint8"):
        processor.process([VIDEO_TOKEN_ID], {"video": [np.zeros((2, 8, 8, 3), np.float32)]})
    with pytest.raises(ValueError, match="1 video placeholder"):
        processor.process([VIDEO_TOKEN_ID], {"video": [random_frames(1, 8, 8)] * 2})
    with pytest.raises(ValueError, match="lack pixel_values_videos"):
        runner.model.embed_multimodal("video", {"pixel_values": torch.zeros(1, 3, SIDE, SIDE)})
    with pytest.raises(ValueError, match="one video"):
        runner.model.embed_multimodal("video", {"pixel_values_videos": torch.zeros(3, SIDE, SIDE)})
    with pytest.raises(ValueError, match="takes images and videos, not 'audio'"):
        runner.model.embed_multimodal("audio", {})
    assert processor.prompt_placeholder("video") == "<video>"
    assert processor.placeholder_token_ids == {"image": IMAGE_TOKEN_ID, "video": VIDEO_TOKEN_ID}
