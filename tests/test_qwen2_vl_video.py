"""Qwen2-VL and Qwen2.5-VL with videos against HF transformers on tiny random checkpoints.

The checkpoints are tests/fixtures_qwen2_vl.py's (no video_preprocessor_config.json: the
video settings fall back to preprocessor_config.json, as transformers' do). HF's video
processor needs torchvision, which is not installed here, so the frames' patches are checked
against HF's IMAGE processor (same resize, PIL bicubic, and normalization) frame by frame:
each video patch row must hold the image rows of its frames, in temporal order, the last
frame repeated to fill a temporal patch. Then, float32: ``mrope_positions`` equals HF's
``get_rope_index`` (a video; an image and a video; Qwen2.5-VL at 2 fps and at the default
24), a prefill with a video gives HF's logits, ``LLM.generate`` gives HF ``generate``'s
greedy tokens and logprobs, another video changes the logits, bad inputs are ValueErrors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from fixtures_qwen2_vl import random_image, save_tiny_qwen2_vl
from mm_hf_compare import answers, arch_checkpoint_fixtures, hf_generate, small_llm
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner

from chassis.builtin_plugins.models.qwen2_vl_media import Qwen2VLMediaInputs
from chassis.core.attention import ForwardContext
from chassis.core.model_loader import load_hf_config
from chassis.core.multimodal import MultiModalFeature
from chassis.core.sampling_params import SamplingParams

ARCHS = ("qwen2_vl", "qwen2_5_vl")
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
NUM_TOKENS = 5
ATOL = 1e-4


model_dirs, hf_models, runners = arch_checkpoint_fixtures(save_tiny_qwen2_vl, ARCHS)


@pytest.fixture(scope="module")
def processors(model_dirs: dict[str, Path]) -> dict[str, Qwen2VLMediaInputs]:
    return {
        arch: Qwen2VLMediaInputs.from_pretrained(d, load_hf_config(d))
        for arch, d in model_dirs.items()
    }


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Any:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(model_dirs["qwen2_vl"])


def random_video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def process(
    processor: Qwen2VLMediaInputs,
    tokenizer: Any,
    prompt: str,
    items: dict[str, list[Any]],
    kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[MultiModalFeature]]:
    ids = tokenizer(prompt).input_ids
    return processor.process(ids, items, kwargs)


def hf_inputs_of(
    ids: list[int], features: list[MultiModalFeature], image_id: int, video_id: int
) -> dict[str, torch.Tensor]:
    """HF's model inputs for our expanded prompt and features: the items' tensors
    concatenated by modality, ``mm_token_type_ids`` (1 image, 2 video) and
    ``second_per_grid_ts``."""
    out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    types = [1 if t == image_id else 2 if t == video_id else 0 for t in ids]
    out["mm_token_type_ids"] = torch.tensor([types], dtype=torch.int32)
    for modality, pixels, grid in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        tensors = [f.tensors() for f in features if f.modality == modality]
        if tensors:
            out[pixels] = torch.cat([t[pixels] for t in tensors])
            out[grid] = torch.cat([t[grid] for t in tensors])
            if modality == "video":
                out["second_per_grid_ts"] = torch.cat([t["second_per_grid_t"] for t in tensors])
    return out


# -- the processor -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "size"),
    [(2, (56, 84)), (3, (56, 56)), (4, (60, 90))],
    ids=["2f", "3f_pad", "resize"],
)
def test_video_patches_hold_the_image_processors_rows(
    model_dirs: dict[str, Path], processors: dict[str, Qwen2VLMediaInputs], frames: int, size: tuple
) -> None:
    """Each video patch row is HF's image rows of its ``temporal_patch_size`` frames (the
    last frame repeated to pad), in HF's video order; grid ``[ceil(T/2), h/14, w/14]``."""
    import transformers as tf

    video = random_video(frames, *size, seed=frames)
    length, tensors = processors["qwen2_vl"].process_item("video", video, {})
    image_processor = tf.AutoImageProcessor.from_pretrained(model_dirs["qwen2_vl"])
    per_frame = []
    for frame in video:
        out = image_processor(images=[frame_image(frame)], return_tensors="pt")
        # an image's rows hold its frame twice (temporal_patch_size 2): keep one, [S, C, p*p]
        per_frame.append(out["pixel_values"].reshape(-1, 3, 2, 14 * 14)[:, :, 0])
        grid = out["image_grid_thw"][0]
    padded = per_frame + [per_frame[-1]] * (-frames % 2)
    expected = torch.cat(
        [
            torch.stack(padded[g : g + 2], dim=2).reshape(len(padded[0]), -1)
            for g in range(0, len(padded), 2)
        ]
    )
    grid_t = len(padded) // 2
    assert tensors["video_grid_thw"].tolist() == [[grid_t, int(grid[1]), int(grid[2])]]
    assert length == grid_t * int(grid[1]) * int(grid[2]) // 4
    torch.testing.assert_close(tensors["pixel_values_videos"], expected, atol=1e-5, rtol=1e-5)
    assert tensors["second_per_grid_t"].tolist() == [pytest.approx(2 / 24)]


def frame_image(frame: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(frame)


def test_a_list_of_pil_frames_is_one_video(
    processors: dict[str, Qwen2VLMediaInputs], tokenizer: Any
) -> None:
    """``{"video": [PIL frames]}`` is one video (vLLM's), the same as its array."""
    from chassis.core.multimodal_inputs import multimodal_items

    video = random_video(2, 56, 56)
    frames = [frame_image(f) for f in video]
    assert len(multimodal_items({"video": frames})["video"]) == 1
    assert len(multimodal_items({"video": [video, video]})["video"]) == 2
    a = process(processors["qwen2_vl"], tokenizer, VIDEO, {"video": [video]})
    b = process(processors["qwen2_vl"], tokenizer, VIDEO, {"video": [frames]})
    assert a[0] == b[0] and a[1][0].identifier == b[1][0].identifier
    assert a[0].count(tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 4


# -- positions and logits ----------------------------------------------------------------------

CASES = {
    "video": (f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n", {"video": [(6, 56, 84)]}),
    "image_video": (
        f"Look at {IMAGE} and then {VIDEO} please.",
        {"image": [(56, 112)], "video": [(3, 84, 56)]},
    ),
}


def items_of(spec: dict[str, list[tuple]], seed: int = 0) -> dict[str, list[Any]]:
    items: dict[str, list[Any]] = {}
    for modality, sizes in spec.items():
        if modality == "image":
            items[modality] = [random_image(*s, seed=seed + i) for i, s in enumerate(sizes)]
        else:
            items[modality] = [random_video(*s, seed=seed + 7 + i) for i, s in enumerate(sizes)]
    return items


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fps", [None, 2.0])
def test_positions_and_prefill_logits_match_transformers(
    processors: dict[str, Qwen2VLMediaInputs],
    tokenizer: Any,
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    case: str,
    fps: float | None,
) -> None:
    prompt, spec = CASES[case]
    hf = hf_models[arch]
    kwargs = {"fps": fps} if fps else {}
    ids, features = process(processors[arch], tokenizer, prompt, items_of(spec), kwargs)
    inputs = hf_inputs_of(ids, features, hf.config.image_token_id, hf.config.video_token_id)
    expected, expected_delta = hf.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs["video_grid_thw"],
        **({"second_per_grid_ts": inputs["second_per_grid_ts"]} if arch == "qwen2_5_vl" else {}),
    )
    model = runners[arch].model
    positions, delta = model.mrope_positions(ids, features)
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    video = next(f for f in features if f.modality == "video")
    steps = np.unique(positions[0, video.offset : video.end] - positions[1, video.offset])
    if arch == "qwen2_5_vl" and fps == 2.0:  # tokens_per_second 4 * 2 frames / 2 fps
        assert steps.tolist() == [0, 4, 8][: len(steps)]
    prefill = prefill_logits(runners[arch], ids, features)
    with torch.no_grad():
        hf_logits = hf(**inputs).logits[0].float()
    torch.testing.assert_close(prefill, hf_logits, atol=ATOL, rtol=ATOL)


def prefill_logits(runner: Runner, ids: list[int], features: list[MultiModalFeature]) -> Any:
    model = runner.model
    positions, _ = model.mrope_positions(ids, features)
    tables = allocate_block_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    kv = new_kv_caches(runner.hf_config, NUM_BLOCKS, BLOCK_SIZE)
    prompt = torch.tensor(ids)
    with torch.no_grad():
        embeds = model.embed_input_ids(prompt)
        for f in features:
            embeds[f.offset : f.end] = model.embed_multimodal(f.modality, f.tensors())
        meta = make_attention_metadata([len(ids)], [len(ids)], tables, BLOCK_SIZE)
        hidden = model(prompt, torch.from_numpy(positions), ForwardContext(meta, kv), embeds)
        return model.compute_logits(hidden)


def test_another_video_changes_the_logits(
    processors: dict[str, Qwen2VLMediaInputs], tokenizer: Any, runners: dict[str, Runner]
) -> None:
    prompt, spec = CASES["video"]
    logits, features = [], []
    for seed in (0, 5):
        ids, feats = process(processors["qwen2_5_vl"], tokenizer, prompt, items_of(spec, seed))
        logits.append(prefill_logits(runners["qwen2_5_vl"], ids, feats))
        features.append(feats[0])
    assert features[0].identifier != features[1].identifier  # the prefix-cache key differs
    end = features[0].end
    assert (logits[0][end:] - logits[1][end:]).abs().max() > 1e-2


# -- through LLM.generate ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_generate_with_videos_matches_hf_generate(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], tokenizer: Any, arch: str
) -> None:
    """A video (as an array, and as PIL frames at 2 fps) and an image + a video in one
    batch: HF ``generate``'s greedy tokens and logprobs."""
    from chassis.core.multimodal_inputs import multimodal_items

    hf = hf_models[arch]
    video_items = items_of(CASES["video"][1])
    pil_video = [frame_image(f) for f in random_video(4, 56, 56, seed=3)]
    requests = [
        {"prompt": CASES["video"][0], "multi_modal_data": {"video": video_items["video"][0]}},
        {
            "prompt": CASES["video"][0],
            "multi_modal_data": {"video": pil_video},
            "mm_processor_kwargs": {"fps": 2.0},
        },
        {"prompt": CASES["image_video"][0], "multi_modal_data": items_of(CASES["image_video"][1])},
    ]
    llm = small_llm(model_dirs[arch])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
        outputs = llm.generate(requests, params)
    finally:
        llm.shutdown()
    processor = Qwen2VLMediaInputs.from_pretrained(model_dirs[arch], hf.config)
    for request, output in zip(requests, outputs, strict=True):
        items = multimodal_items(request["multi_modal_data"])
        ids, features = process(
            processor, tokenizer, request["prompt"], items, request.get("mm_processor_kwargs")
        )
        assert list(output.prompt_token_ids) == ids
        inputs = hf_inputs_of(ids, features, hf.config.image_token_id, hf.config.video_token_id)
        if arch == "qwen2_vl":
            inputs.pop("second_per_grid_ts")
        [answer] = answers([output])
        answer.assert_matches(hf_generate(hf, inputs, NUM_TOKENS), request["prompt"])


# -- bad input ---------------------------------------------------------------------------------


def test_bad_videos_are_clear_errors(
    model_dirs: dict[str, Path], processors: dict[str, Qwen2VLMediaInputs], tokenizer: Any
) -> None:
    from chassis import LLM

    processor = processors["qwen2_vl"]
    good = random_video(2, 56, 56)
    bad = {
        "must be uint8": good.astype(np.float32),
        r"must be \[frames, height, width, 3\]": good[..., :2],
        "got shape": good[0],
        "non-empty list of PIL": [],
        "share one size": [random_image(56, 56), random_image(56, 84)],
        "must be a numpy array": "video.mp4",
    }
    for message, video in bad.items():
        with pytest.raises(ValueError, match=message):
            process(processor, tokenizer, VIDEO, {"video": [video]})
    with pytest.raises(ValueError, match="fps must be a number > 0"):
        process(processor, tokenizer, VIDEO, {"video": [good]}, {"fps": 0})
    with pytest.raises(ValueError, match="num_frames not supported"):
        process(processor, tokenizer, VIDEO, {"video": [good]}, {"num_frames": 4})
    with pytest.raises(ValueError, match="1 video placeholder"):
        process(processor, tokenizer, VIDEO, {"video": [good, good]})
    llm = LLM(
        str(model_dirs["qwen2_vl"]),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        limit_mm_per_prompt={"video": 1, "image": 0},
    )
    try:
        with pytest.raises(ValueError, match=r"At most 1 video\(s\)"):
            llm.generate({"prompt": VIDEO * 2, "multi_modal_data": {"video": [good, good]}})
        with pytest.raises(ValueError, match=r"At most 0 image\(s\)"):
            llm.generate({"prompt": IMAGE, "multi_modal_data": {"image": random_image(56, 56)}})
        # the engine still serves a video after the refusals
        (out,) = llm.generate(
            {"prompt": VIDEO, "multi_modal_data": {"video": good}},
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_qwen3_vl_takes_videos_through_its_own_processor() -> None:
    """Qwen3-VL puts timestamps between frames: its videos go through its own processor
    (tests/test_qwen3_vl_video.py), not this one."""
    from chassis.builtin_plugins.models.qwen3_vl import Qwen3VLForConditionalGeneration

    assert Qwen3VLForConditionalGeneration.supported_modalities == frozenset({"image", "video"})
