"""GLM-4.1V and GLM-4.5V with videos against HF transformers on tiny random checkpoints.

The checkpoints are tests/fixtures_glm4v.py's, with a chat template that renders a video
part as ``<|begin_of_video|><|video|><|end_of_video|>`` and a ``video_preprocessor_config.json``
(pixel bounds over all of a clip's frames: 2x56x56 to 8x112x112). HF's video processor needs
torchvision (not installed here) to resize and normalize, so its reference is built from the
parts that do not: ``get_num_of_video_patches`` (its ``smart_resize``) sizes each clip, its
``patchify`` cuts the frames (normalized as its fused rescale-and-normalize does), and
``Glm4vProcessor.replace_video_token`` writes the prompt text (per temporal patch group
``<|begin_of_image|>``, the ``<|image|>`` tokens, ``<|end_of_image|>`` and its second), its
``create_mm_token_type_ids`` the token types. Checked, float32: pixel values, grids and the
expanded prompt for several frame counts, sizes and timings; the video rows against
``get_video_features``; ``mrope_positions`` against ``get_rope_index`` and prefill logits
against HF's forward for one and two videos; ``LLM.generate`` greedy tokens and logprobs
against HF ``generate`` (both classes), with chunked prefill cutting through the video and a
prefix-cache hit; a chat ``video_url`` part (an MP4 encoded losslessly with PyAV); bad videos
and too many videos are clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_glm4v import CHAT_TEMPLATE, PLACEHOLDER, save_tiny_glm4v
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from fixtures_qwen2_vl import random_image
from mm_hf_compare import PARAMS, answers, answers_and_cached, hf_generate, hf_image_text_model
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner
from test_multimodal_engine import vl_llm

from chassis import SamplingParams
from chassis.builtin_plugins.models.glm4v_media import Glm4vMediaInputs
from chassis.core.attention import ForwardContext
from chassis.core.model_loader import load_hf_config
from chassis.core.multimodal import MultiModalFeature

ARCHS = ("glm4v", "glm4v_moe")
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"
IMAGE_TOKEN_ID = 49156  # <|image|>: GLM's video frames use it too
#: the fixture's template with video parts
VIDEO_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif p.type == 'text' %}",
    "{% elif p.type in ['video', 'video_url'] %}" + VIDEO + "{% elif p.type == 'text' %}",
)
#: the video processor's bounds: pixels over all frames (patch 14, merge 2)
VIDEO_CONFIG = {
    "size": {"shortest_edge": 2 * 56 * 56, "longest_edge": 8 * 112 * 112},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "processor_class": "Glm4vProcessor",
    "video_processor_type": "Glm4vVideoProcessor",
}
#: (frames, height, width, metadata) of videos that need no resize
CLIPS = {
    "4x56x84": (4, 56, 84, None),
    "3x56x56_loaded": (3, 56, 56, {"fps": 4, "frames_indices": [0, 4, 9], "total_num_frames": 10}),
    "6x84x56_slow": (6, 84, 56, {"fps": 0.5}),
}


def chat(text: str, media: str = VIDEO) -> str:
    return f"<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers as tf

    dirs = {}
    for arch in ARCHS:
        d = save_tiny_glm4v(tmp_path_factory.mktemp(arch), arch)
        tokenizer = tf.AutoTokenizer.from_pretrained(d)
        tokenizer.chat_template = VIDEO_CHAT_TEMPLATE
        tokenizer.save_pretrained(d)
        (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
        dirs[arch] = d
    return dirs


@pytest.fixture(scope="module")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {arch: hf_image_text_model(d) for arch, d in model_dirs.items()}


@pytest.fixture(scope="module")
def runner(model_dirs: dict[str, Path]) -> Runner:
    return Runner(model_dirs["glm4v"])


@pytest.fixture(scope="module")
def processor(model_dirs: dict[str, Path]) -> Glm4vMediaInputs:
    d = model_dirs["glm4v"]
    return Glm4vMediaInputs.from_pretrained(d, load_hf_config(d))


@pytest.fixture(scope="module")
def hf_processor(model_dirs: dict[str, Path]) -> Any:
    import transformers as tf
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    # (its constructor looks the video processor class up, which needs torchvision: the
    # attributes replace_video_token and create_mm_token_type_ids read are set directly)
    d = model_dirs["glm4v"]
    processor = tf.Glm4vProcessor.__new__(tf.Glm4vProcessor)
    processor.tokenizer = tokenizer = tf.AutoTokenizer.from_pretrained(d)
    processor.video_processor = Glm4vVideoProcessor.from_pretrained(d)
    processor.image_token, processor.video_token = "<|image|>", "<|video|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image|>")
    processor.video_start_id = tokenizer.convert_tokens_to_ids("<|begin_of_video|>")
    processor.video_end_id = tokenizer.convert_tokens_to_ids("<|end_of_video|>")
    return processor


def random_video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def item_of(video: np.ndarray, metadata: dict[str, Any] | None) -> Any:
    return video if metadata is None else (video, metadata)


def hf_video(hf_processor: Any, video: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``pixel_values_videos`` and ``video_grid_thw`` of a clip that needs no resize."""
    vp = hf_processor.video_processor
    count, height, width, _ = video.shape
    assert vp.get_num_of_video_patches(count, height, width) == (
        (count + count % 2) * height * width // 14**2 // 2
    )
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
    default metadata for bare frames: no fps, frames numbered 0, 1, ...)."""
    from transformers.video_utils import VideoMetadata

    meta = {"total_num_frames": count, "fps": None, "frames_indices": list(range(count))}
    meta.update(metadata or {})
    inputs = {"video_grid_thw": grid, "video_metadata": [VideoMetadata(**meta)]}
    text = prompt.replace("<|video|>", hf_processor.replace_video_token(inputs, 0))
    return hf_processor.tokenizer(text).input_ids


def hf_inputs_of(
    hf_processor: Any, ids: list[int], features: list[MultiModalFeature]
) -> dict[str, torch.Tensor]:
    """HF's model inputs for our expanded prompt and features (token types by HF's rule)."""
    out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    for feature in features:
        for name, tensor in feature.tensors().items():
            if name != "placeholder_ids":
                out.setdefault(name, []).append(tensor)
    out = {k: torch.cat(v) if isinstance(v, list) else v for k, v in out.items()}
    types = hf_processor.create_mm_token_type_ids([ids])
    out["mm_token_type_ids"] = torch.tensor(types, dtype=torch.int32)
    return out


def process(
    processor: Glm4vMediaInputs, prompt: str, items: dict[str, list[Any]], **kwargs: Any
) -> tuple[list[int], list[MultiModalFeature]]:
    ids = processor.tokenizer()(prompt).input_ids
    return processor.process(ids, items, kwargs)


# -- the processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("clip", list(CLIPS))
def test_pixels_and_prompt_match_the_hf_processor(
    processor: Glm4vMediaInputs, hf_processor: Any, clip: str
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
    assert run.count(IMAGE_TOKEN_ID) == int(grid.prod()) // 4
    # the prompt's own <|begin_of_video|> and <|end_of_video|> around the run, as HF's
    assert (ids[feature.offset - 1], ids[feature.end]) == (
        hf_processor.video_start_id,
        hf_processor.video_end_id,
    )
    if clip == "6x84x56_slow":  # frames 0, 2, 4 at 0.5 fps: seconds 0, 4, 8
        assert "<|end_of_image|>4<|begin_of_image|>" in processor.tokenizer().decode(run)


def test_resized_clips_get_hf_grids(processor: Glm4vMediaInputs, hf_processor: Any) -> None:
    """Clips that need resizing (down, up, a single-token side) get HF's patch count; a list
    of PIL frames is one video; the request's ``fps`` times raw frames as metadata would."""
    vp = hf_processor.video_processor
    for count, height, width in ((4, 50, 70), (2, 28, 28), (8, 112, 140), (5, 20, 200)):
        _, [feature] = process(
            processor, chat("x"), {"video": [random_video(count, height, width)]}
        )
        patches = vp.get_num_of_video_patches(count, height, width)
        grid = feature.tensors()["video_grid_thw"]
        assert int(grid.prod()) == patches
        assert feature.tensors()["pixel_values_videos"].shape == (patches, 3 * 2 * 14 * 14)
    from PIL import Image

    video = random_video(6, 56, 84, seed=3)
    frames = [Image.fromarray(f) for f in video]
    a = process(processor, chat("x"), {"video": [frames]}, fps=0.5)
    b = process(processor, chat("x"), {"video": [(video, {"fps": 0.5})]})
    assert a[0] == b[0] and a[1][0].identifier == b[1][0].identifier
    c = process(processor, chat("x"), {"video": [video]})  # 24 fps: other timestamps
    assert c[0] != a[0]


def test_image_pixel_bounds_leave_videos_as_hf(
    processor: Glm4vMediaInputs, hf_processor: Any
) -> None:
    """``min_pixels`` / ``max_pixels`` shrink the request's image but not its video: HF's
    ``Glm4vVideoProcessor`` takes neither, so the clip keeps the checkpoint's video bounds
    (HF's patch count for the same kwargs); bounds that sized the clip would shrink it."""
    import dataclasses

    from chassis.builtin_plugins.models.qwen3_vl_video import frame_size

    bounds = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
    count, height, width = 4, 112, 140
    items = {"image": [random_image(112, 112)], "video": [random_video(count, height, width)]}
    prompt = chat("x", PLACEHOLDER + VIDEO)
    plain = process(processor, prompt, items)[1]
    bounded = process(processor, prompt, items, **bounds)[1]
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
    assert count // 2 * (h // 14) * (w // 14) < expected


def test_bad_videos_are_clear_errors(processor: Glm4vMediaInputs) -> None:
    cases = [
        (random_video(1, 56, 56), "at least 2 frames"),
        ((random_video(3, 56, 56), {"fps": 2, "frames_indices": [0, 1]}), "one per frame"),
        ((random_video(2, 56, 56), {"fps": -1}), "number > 0"),
        (np.zeros((2, 56, 56), dtype=np.uint8), r"\[frames, height, width, 3\]"),
    ]
    for video, match in cases:
        with pytest.raises(ValueError, match=match):
            process(processor, chat("x"), {"video": [video]})
    with pytest.raises(ValueError, match="1 video placeholder"):
        process(processor, chat("x"), {"video": [random_video(2, 56, 56)] * 2})


# -- the model -------------------------------------------------------------------------------


def test_video_rows_match_get_video_features(
    runner: Runner, processor: Glm4vMediaInputs, hf_models: dict[str, Any]
) -> None:
    """The run's rows: HF's video rows at its ``<|image|>`` tokens (1e-5), the token
    embeddings elsewhere."""
    _, [feature] = process(processor, chat("x"), {"video": [random_video(4, 56, 84)]})
    tensors = feature.tensors()
    with torch.no_grad():
        rows = runner.model.embed_multimodal("video", tensors)
        out = hf_models["glm4v"].model.get_video_features(
            tensors["pixel_values_videos"], tensors["video_grid_thw"]
        )
        text_rows = runner.model.embed_input_ids(tensors["placeholder_ids"])
    is_video = tensors["placeholder_ids"] == IMAGE_TOKEN_ID
    torch.testing.assert_close(rows[is_video], out.pooler_output[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(rows[~is_video], text_rows[~is_video])
    assert rows.shape == (feature.length, 64)


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


@pytest.mark.parametrize("case", ["video", "two_videos"])
def test_positions_and_prefill_logits_match_transformers(
    runner: Runner,
    processor: Glm4vMediaInputs,
    hf_processor: Any,
    hf_models: dict[str, Any],
    case: str,
) -> None:
    hf = hf_models["glm4v"]
    video = (random_video(6, 84, 56, seed=1), {"fps": 1, "frames_indices": [0, 1, 2, 3, 4, 5]})
    items: dict[str, list[Any]] = {"video": [video]}
    prompt = chat("Describe the clip.")
    if case == "two_videos":
        prompt = chat("Compare.", f"{VIDEO} and {VIDEO}")
        items["video"].append(random_video(2, 56, 112, seed=3))
    ids, features = process(processor, prompt, items)
    inputs = hf_inputs_of(hf_processor, ids, features)
    positions, delta = runner.model.mrope_positions(ids, features)
    expected, expected_delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], None, inputs["video_grid_thw"]
    )
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    with torch.no_grad():
        hf_logits = hf(**inputs).logits[0]
    torch.testing.assert_close(
        prefill_logits(runner, ids, features), hf_logits, atol=1e-4, rtol=1e-4
    )


# -- through the engine ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_generate_with_videos_matches_hf_generate(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], hf_processor: Any, arch: str
) -> None:
    """A video, a loaded video, and text in one batch; then the first again with steps of 8
    tokens cutting through its run (encoded once), and once more from the prefix cache:
    HF's answers."""
    model_dir = model_dirs[arch]
    processor = Glm4vMediaInputs.from_pretrained(model_dir, load_hf_config(model_dir))
    loaded = (random_video(4, 56, 84, seed=5), {"fps": 2, "frames_indices": [0, 3, 6, 9]})
    cases = [
        (chat("What happens?"), {"video": [random_video(3, 56, 56, seed=4)]}),
        (chat("And here?"), {"video": [loaded]}),
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
        expected = hf_generate(hf_models[arch], hf_inputs_of(hf_processor, ids, features))
        answer.assert_matches(expected, prompt)
    if arch != "glm4v":
        return
    llm = vl_llm(model_dir, block_size=4, max_num_batched_tokens=8)
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


def test_chat_with_a_video_url(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], hf_processor: Any
) -> None:
    """``LLM.chat`` with a ``video_url`` part (an MP4 data URL, 10 frames at 2 fps, all
    kept): the chat template's prompt, the video's timing in the timestamps, HF's answer."""
    pytest.importorskip("av")
    from test_video_urls import data_url, encode_video

    from chassis.core.video_loading import decode_video

    model_dir = model_dirs["glm4v"]
    frames = random_video(10, 56, 56, seed=8)
    mp4 = encode_video(frames, fps=2)
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
    processor = Glm4vMediaInputs.from_pretrained(model_dir, load_hf_config(model_dir))
    ids, features = process(processor, chat("What happens?"), {"video": [decode_video(mp4, "t")]})
    assert list(output.prompt_token_ids) == ids
    # frames 0, 2, 4, 6, 8 at 2 fps: seconds 0 .. 4
    assert "<|end_of_image|>4<|end_of_video|>" in processor.tokenizer().decode(ids)
    [answer] = answers([output])
    expected = hf_generate(hf_models["glm4v"], hf_inputs_of(hf_processor, ids, features))
    answer.assert_matches(expected, "chat")


def test_limit_and_an_image_beside_a_video(model_dirs: dict[str, Path]) -> None:
    """``limit_mm_per_prompt`` caps videos; an image and a video in one prompt are served
    (HF's forward cannot take both: its video mask is its image mask)."""
    from chassis import LLM

    video = random_video(2, 56, 56)
    llm = LLM(
        str(model_dirs["glm4v"]),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        limit_mm_per_prompt={"video": 1, "image": 1},
    )
    try:
        with pytest.raises(ValueError, match=r"At most 1 video\(s\)"):
            llm.generate({"prompt": VIDEO * 2, "multi_modal_data": {"video": [video, video]}})
        (out,) = llm.generate(
            {
                "prompt": chat("Both?", PLACEHOLDER + VIDEO),
                "multi_modal_data": {"image": random_image(56, 84), "video": video},
            },
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
