"""Qwen3-VL and Qwen3-VL-MoE with videos against HF transformers on tiny random checkpoints.

The checkpoints are tests/fixtures_qwen3_vl.py's, with a ``video_preprocessor_config.json``
(pixel bounds over all of a clip's frames: 2x64x64 to 8x128x128). HF's video processor needs
torchvision (not installed here) to resize and normalize, so its reference is built from the
parts that do not: its ``smart_resize`` sizes each clip, its ``patchify`` cuts the frames
(normalized as its fused rescale-and-normalize does), and ``Qwen3VLProcessor.
replace_video_token`` writes the prompt text (timestamps, one ``<|vision_start|>`` ...
``<|vision_end|>`` per temporal patch group). Checked, float32: pixel values, grids and the
expanded prompt for several frame counts, sizes and timings; the video rows and deepstack
rows against ``get_video_features``; ``mrope_positions`` against ``get_rope_index``; prefill
logits with a video (and an image); ``LLM.generate`` greedy tokens and logprobs against HF
``generate`` (both classes), with chunked prefill cutting through the video; a chat
``video_url`` part (an MP4 encoded losslessly with PyAV); bad videos are clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from fixtures_qwen2_vl import random_image
from fixtures_qwen3_vl import ARCHS, save_tiny_qwen3_vl
from mm_hf_compare import PARAMS, Answer, answers, hf_generate, hf_image_text_model
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner
from test_multimodal_engine import vl_llm

from chassis.builtin_plugins.models.qwen3_vl_media import Qwen3VLMediaInputs
from chassis.core.attention import ForwardContext
from chassis.core.model_loader import load_hf_config
from chassis.core.multimodal import MultiModalFeature

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 49154, 49155
#: the video processor's bounds: pixels over all frames (patch 16, merge 2)
VIDEO_CONFIG = {
    "size": {"shortest_edge": 2 * 64 * 64, "longest_edge": 8 * 128 * 128},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
#: (frames, height, width, metadata) of videos that need no resize
CLIPS = {
    "4x64x96": (4, 64, 96, None),
    "3x64x64_loaded": (3, 64, 64, {"fps": 4, "frames_indices": [0, 4, 9], "total_num_frames": 10}),
    "6x96x64_fps": (6, 96, 64, {"fps": 2.5}),
}


def chat(text: str, media: str = VIDEO) -> str:
    return f"<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for arch in ARCHS:
        d = save_tiny_qwen3_vl(tmp_path_factory.mktemp(arch), arch)
        (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
        dirs[arch] = d
    return dirs


@pytest.fixture(scope="module")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {arch: hf_image_text_model(d) for arch, d in model_dirs.items()}


@pytest.fixture(scope="module")
def runner(model_dirs: dict[str, Path]) -> Runner:
    return Runner(model_dirs["qwen3_vl"])


@pytest.fixture(scope="module")
def processor(model_dirs: dict[str, Path]) -> Qwen3VLMediaInputs:
    d = model_dirs["qwen3_vl"]
    return Qwen3VLMediaInputs.from_pretrained(d, load_hf_config(d))


@pytest.fixture(scope="module")
def hf_processor(model_dirs: dict[str, Path]) -> Any:
    import transformers as tf
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # (its constructor looks the video processor class up, which needs torchvision: the
    # attributes replace_video_token reads are set directly)
    d = model_dirs["qwen3_vl"]
    processor = tf.Qwen3VLProcessor.__new__(tf.Qwen3VLProcessor)
    processor.tokenizer = tf.AutoTokenizer.from_pretrained(d)
    processor.video_processor = Qwen3VLVideoProcessor.from_pretrained(d)
    processor.video_token = "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    return processor


def random_video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def item_of(video: np.ndarray, metadata: dict[str, Any] | None) -> Any:
    return video if metadata is None else (video, metadata)


def hf_video(hf_processor: Any, video: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``pixel_values_videos`` and ``video_grid_thw`` of a clip that needs no resize."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    vp = hf_processor.video_processor
    count, height, width, _ = video.shape
    size = vp.size
    factor = vp.patch_size * vp.merge_size
    resized = smart_resize(
        count, height, width, 2, factor, size["shortest_edge"], size["longest_edge"]
    )
    assert resized == (height, width)
    frames = torch.from_numpy(video).permute(0, 3, 1, 2).float()[None]  # [1, T, C, H, W]
    # the fused rescale and normalize of HF's video processor
    mean = torch.tensor(vp.image_mean) * (1.0 / vp.rescale_factor)
    std = torch.tensor(vp.image_std) * (1.0 / vp.rescale_factor)
    frames = (frames - mean.view(1, 1, 3, 1, 1)) / std.view(1, 1, 3, 1, 1)
    patches, t, h, w = vp.patchify(frames, vp.patch_size, vp.merge_size, vp.temporal_patch_size)
    return patches[0], torch.tensor([[t, h, w]])


def hf_prompt_ids(
    hf_processor: Any, prompt: str, grid: torch.Tensor, metadata: dict[str, Any] | None, count: int
) -> list[int]:
    """HF's expanded prompt: ``replace_video_token`` with the video's metadata (transformers'
    default metadata for bare frames)."""
    from transformers.video_utils import VideoMetadata

    meta = {"total_num_frames": count, "fps": None, "frames_indices": list(range(count))}
    meta.update(metadata or {})
    inputs = {"video_grid_thw": grid, "video_metadata": [VideoMetadata(**meta)]}
    text = prompt.replace("<|video_pad|>", hf_processor.replace_video_token(inputs, 0))
    return hf_processor.tokenizer(text).input_ids


def hf_inputs_of(ids: list[int], features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
    """HF's model inputs for our expanded prompt and features."""
    out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    for feature in features:
        for name, tensor in feature.tensors().items():
            if name != "placeholder_ids":
                out.setdefault(name, []).append(tensor)
    out = {k: torch.cat(v) if isinstance(v, list) else v for k, v in out.items()}
    types = torch.zeros(1, len(ids), dtype=torch.int32)
    types[out["input_ids"] == IMAGE_TOKEN_ID] = 1
    types[out["input_ids"] == VIDEO_TOKEN_ID] = 2
    out["mm_token_type_ids"] = types
    return out


def process(
    processor: Qwen3VLMediaInputs, prompt: str, items: dict[str, list[Any]], **kwargs: Any
) -> tuple[list[int], list[MultiModalFeature]]:
    ids = processor.tokenizer()(prompt).input_ids
    return processor.process(ids, items, kwargs)


# -- the processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("clip", list(CLIPS))
def test_pixels_and_prompt_match_the_hf_processor(
    processor: Qwen3VLMediaInputs, hf_processor: Any, clip: str
) -> None:
    count, height, width, metadata = CLIPS[clip]
    video = random_video(count, height, width)
    prompt = chat("What happens?")
    ids, [feature] = process(processor, prompt, {"video": [item_of(video, metadata)]})
    pixels, grid = hf_video(hf_processor, video)
    tensors = feature.tensors()
    assert torch.equal(tensors["video_grid_thw"], grid)
    torch.testing.assert_close(tensors["pixel_values_videos"], pixels, atol=1e-5, rtol=0)
    assert ids == hf_prompt_ids(hf_processor, prompt, grid, metadata, count)
    run = ids[feature.offset : feature.end]
    assert run == tensors["placeholder_ids"].tolist()
    assert run.count(VIDEO_TOKEN_ID) == int(grid.prod()) // 4
    # the prompt's own <|vision_start|> and <|vision_end|> around the run, as HF's
    assert (ids[feature.offset - 1], ids[feature.end]) == (49152, 49153)


def test_resized_clips_get_hf_grids(processor: Qwen3VLMediaInputs, hf_processor: Any) -> None:
    """Clips that need resizing (down, up, a single-token side) get HF's grid; a list of PIL
    frames is one video; the request's ``fps`` times raw frames as metadata would."""
    vp = hf_processor.video_processor
    for count, height, width in ((4, 50, 70), (2, 32, 32), (8, 128, 160), (5, 20, 200)):
        _, [feature] = process(
            processor, chat("x"), {"video": [random_video(count, height, width)]}
        )
        patches = vp.get_num_of_video_patches(count, height, width)
        grid = feature.tensors()["video_grid_thw"]
        assert int(grid.prod()) == patches and feature.tensors()["pixel_values_videos"].shape == (
            patches,
            3 * 2 * 16 * 16,
        )
    from PIL import Image

    video = random_video(4, 64, 96, seed=3)
    frames = [Image.fromarray(f) for f in video]
    a = process(processor, chat("x"), {"video": [frames]}, fps=2.0)
    b = process(processor, chat("x"), {"video": [(video, {"fps": 2.0})]})
    assert a[0] == b[0] and a[1][0].identifier == b[1][0].identifier
    c = process(processor, chat("x"), {"video": [video]})  # 24 fps: other timestamps
    assert c[0] != a[0]


def test_image_pixel_bounds_leave_videos_as_hf(
    processor: Qwen3VLMediaInputs, hf_processor: Any
) -> None:
    """``min_pixels`` / ``max_pixels`` shrink the request's image but not its video: HF's
    video processor takes neither, so the clip keeps the checkpoint's video bounds (HF's
    patch count for the same kwargs); bounds that sized the clip would shrink it."""
    import dataclasses

    from chassis.builtin_plugins.models.qwen3_vl_video import frame_size

    bounds = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    count, height, width = 4, 128, 160
    items = {"image": [random_image(128, 128)], "video": [random_video(count, height, width)]}
    plain = process(processor, chat("x", IMAGE + VIDEO), items)[1]
    bounded = process(processor, chat("x", IMAGE + VIDEO), items, **bounds)[1]
    (image_plain, video_plain), (image_bounded, video_bounded) = (
        [next(f.tensors() for f in features if f.modality == m) for m in ("image", "video")]
        for features in (plain, bounded)
    )
    # the image shrank; the clip's pixels are the same
    assert image_bounded["image_grid_thw"].prod() < image_plain["image_grid_thw"].prod()
    assert torch.equal(video_bounded["pixel_values_videos"], video_plain["pixel_values_videos"])
    vp = hf_processor.video_processor
    expected = vp.get_num_of_video_patches(count, height, width, dict(bounds))
    assert expected == vp.get_num_of_video_patches(count, height, width)
    assert int(video_bounded["video_grid_thw"].prod()) == expected
    h, w = frame_size(count, height, width, dataclasses.replace(processor.video_settings, **bounds))
    assert count // 2 * (h // 16) * (w // 16) < expected


def test_the_per_frame_cap_matches_hf(processor: Qwen3VLMediaInputs, hf_processor: Any) -> None:
    """With ``cap_pixels_per_frame`` (and a ``max_video_tokens`` of 8) the clip's frame size
    gives HF's patch count."""
    import copy
    import dataclasses

    from chassis.builtin_plugins.models.qwen3_vl_video import frame_size

    settings = dataclasses.replace(
        processor.video_settings, cap_pixels_per_frame=True, max_video_tokens=8
    )
    vp = copy.copy(hf_processor.video_processor)
    vp.max_video_tokens = 8
    for count, height, width in ((4, 128, 160), (16, 128, 128), (2, 64, 64)):
        h, w = frame_size(count, height, width, settings)
        expected = vp.get_num_of_video_patches(count, height, width, {"cap_pixels_per_frame": True})
        assert (count + count % 2) // 2 * (h // 16) * (w // 16) == expected


def test_bad_videos_are_clear_errors(processor: Qwen3VLMediaInputs) -> None:
    cases = [
        (random_video(1, 64, 64), "at least 2 frames"),
        ((random_video(3, 64, 64), {"fps": 2, "frames_indices": [0, 1]}), "one per frame"),
        ((random_video(2, 64, 64), {"fps": -1}), "number > 0"),
        (np.zeros((2, 64, 64), dtype=np.uint8), r"\[frames, height, width, 3\]"),
    ]
    for video, match in cases:
        with pytest.raises(ValueError, match=match):
            process(processor, chat("x"), {"video": [video]})


# -- the model -------------------------------------------------------------------------------


def test_video_rows_match_get_video_features(
    runner: Runner, processor: Qwen3VLMediaInputs, hf_models: dict[str, Any]
) -> None:
    """The run's rows: HF's video rows and deepstack rows at its pad tokens (1e-5), the
    token embeddings (deepstack columns zero) elsewhere."""
    _, [feature] = process(processor, chat("x"), {"video": [random_video(4, 64, 96)]})
    tensors = feature.tensors()
    with torch.no_grad():
        rows = runner.model.embed_multimodal("video", tensors)
        out = hf_models["qwen3_vl"].model.get_video_features(
            tensors["pixel_values_videos"], tensors["video_grid_thw"]
        )
        text_rows = runner.model.embed_input_ids(tensors["placeholder_ids"])
    is_video = tensors["placeholder_ids"] == VIDEO_TOKEN_ID
    expected = torch.cat([out.pooler_output[0], *(f[0] for f in out.deepstack_features)], -1)
    torch.testing.assert_close(rows[is_video], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(rows[~is_video], text_rows[~is_video])
    assert rows.shape == (feature.length, 64 * 3)


def prefill_logits(runner: Runner, ids: list[int], features: list[MultiModalFeature]) -> Any:
    model = runner.model
    positions, _ = model.mrope_positions(ids, features)
    tables = allocate_block_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    kv = new_kv_caches(runner.hf_config, NUM_BLOCKS, BLOCK_SIZE)
    prompt = torch.tensor(ids)
    with torch.no_grad():
        embeds = model.embed_input_ids(prompt)
        for feature in features:
            embeds[feature.offset : feature.end] = model.embed_multimodal(
                feature.modality, feature.tensors()
            )
        meta = make_attention_metadata([len(ids)], [len(ids)], tables, BLOCK_SIZE)
        hidden = model(prompt, torch.from_numpy(positions), ForwardContext(meta, kv), embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("case", ["video", "image_and_video", "two_videos"])
def test_positions_and_prefill_logits_match_transformers(
    runner: Runner, processor: Qwen3VLMediaInputs, hf_models: dict[str, Any], case: str
) -> None:
    hf = hf_models["qwen3_vl"]
    video = (random_video(6, 96, 64, seed=1), {"fps": 3, "frames_indices": [0, 2, 4, 6, 8, 10]})
    items: dict[str, list[Any]] = {"video": [video]}
    prompt = chat("Describe the clip.")
    if case == "image_and_video":
        prompt = chat("Compare.", f"Picture {IMAGE} then clip {VIDEO}")
        items["image"] = [random_image(64, 96, 2)]
    elif case == "two_videos":
        prompt = chat("Compare.", f"{VIDEO} and {VIDEO}")
        items["video"].append(random_video(2, 64, 128, seed=3))
    ids, features = process(processor, prompt, items)
    inputs = hf_inputs_of(ids, features)
    positions, delta = runner.model.mrope_positions(ids, features)
    expected, expected_delta = hf.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs["video_grid_thw"],
    )
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    with torch.no_grad():
        hf_logits = hf(**inputs).logits[0]
    torch.testing.assert_close(
        prefill_logits(runner, ids, features), hf_logits, atol=1e-4, rtol=1e-4
    )


# -- through the engine ----------------------------------------------------------------------


def hf_answer(hf: Any, ids: list[int], features: list[MultiModalFeature]) -> Answer:
    """HF ``generate``'s greedy answer on our expanded prompt and features."""
    return hf_generate(hf, hf_inputs_of(ids, features))


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_generate_with_videos_matches_hf_generate(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], arch: str
) -> None:
    """A video, a loaded video with an image, and text in one batch; then the first again
    with steps of 8 tokens cutting through its run (encoded once): HF's answers."""
    model_dir = model_dirs[arch]
    processor = Qwen3VLMediaInputs.from_pretrained(model_dir, load_hf_config(model_dir))
    loaded = (random_video(4, 64, 96, seed=5), {"fps": 4, "frames_indices": [0, 3, 6, 9]})
    cases = [
        (chat("What happens?"), {"video": [random_video(3, 64, 64, seed=4)]}),
        (
            chat("And here?", f"{IMAGE}{VIDEO}"),
            {"image": [random_image(96, 64, 6)], "video": [loaded]},
        ),
        (chat("No media.", ""), {}),
    ]
    prompts = [{"prompt": p, "multi_modal_data": m} if m else p for p, m in cases]
    llm = vl_llm(model_dir)
    try:
        got = answers(llm.generate(prompts, PARAMS))
    finally:
        llm.shutdown()
    for (prompt, items), answer in zip(cases, got, strict=True):
        ids, features = process(processor, prompt, items)
        answer.assert_matches(hf_answer(hf_models[arch], ids, features), prompt)
    if arch != "qwen3_vl":
        return
    llm = vl_llm(model_dir, block_size=4, max_num_batched_tokens=8)
    try:
        [chunked] = answers(llm.generate([prompts[0]], PARAMS))
        assert llm.engine.executor.worker.runner.mm.num_encoder_runs == 1
    finally:
        llm.shutdown()
    assert chunked.tokens == got[0].tokens
    np.testing.assert_allclose(chunked.logprobs, got[0].logprobs, atol=1e-4)


def test_chat_with_a_video_url(model_dirs: dict[str, Path], hf_models: dict[str, Any]) -> None:
    """``LLM.chat`` with a ``video_url`` part (an MP4 data URL, 10 frames at 4 fps, 32 kept:
    all): the chat template's prompt, the video's timing in the timestamps, HF's answer."""
    pytest.importorskip("av")
    from test_video_urls import data_url, encode_video

    from chassis.core.video_loading import decode_video

    model_dir = model_dirs["qwen3_vl"]
    frames = random_video(10, 64, 64, seed=8)
    mp4 = encode_video(frames, fps=4)
    content = [
        {"type": "video_url", "video_url": {"url": data_url(mp4)}},
        {"type": "text", "text": "What happens?"},
    ]
    llm = vl_llm(model_dir)
    try:
        [output] = llm.chat([{"role": "user", "content": content}], PARAMS)
    finally:
        llm.shutdown()
    assert output.prompt == chat("What happens?")
    processor = Qwen3VLMediaInputs.from_pretrained(model_dir, load_hf_config(model_dir))
    ids, features = process(processor, chat("What happens?"), {"video": [decode_video(mp4, "t")]})
    assert list(output.prompt_token_ids) == ids
    assert "<1.1 seconds>" in processor.tokenizer().decode(ids)  # frames 4 and 5 at 4 fps
    [answer] = answers([output])
    answer.assert_matches(hf_answer(hf_models["qwen3_vl"], ids, features), "chat")
