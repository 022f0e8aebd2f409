"""Qwen2-VL and Qwen2.5-VL with images against HF transformers on tiny random checkpoints.

tests/fixtures_qwen2_vl.py writes each checkpoint (2 text layers, a 2-block vision tower;
Qwen2.5-VL's first block windowed, 56-pixel windows) with HF's image processor. Checked here,
float32: the vision tower's rows equal HF's ``visual`` module's (one image, two images of
different sizes in one call, a Qwen2.5-VL image of several windows); ``mrope_positions``
equals HF's ``get_rope_index`` for prompts with 0, 1 and 2 images; a prefill of the whole
prompt (image rows put in place of the placeholders' embeddings, positions ``[3, P]``) gives
HF's logits, and so does the decode step after it (1-D position ``P + delta``); an image
changes the logits. Also: M-RoPE against HF's rotation, both weight layouts, bad inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from fixtures_qwen2_vl import hf_inputs, random_image, save_tiny_qwen2_vl
from mm_hf_compare import (
    arch_checkpoint_fixtures,
    read_tensors,
)
from mm_hf_compare import hf_logits as hf_logits_with_images
from safetensors.torch import load_file, save_file
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner

from chassis.builtin_plugins.models.qwen2_5_vl_vision import window_order
from chassis.core.attention import ForwardContext
from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.layers.rotary import rope_parameters
from chassis.core.multimodal import MultiModalFeature, make_feature

ARCHS = ("qwen2_vl", "qwen2_5_vl")
PAD = "<|image_pad|>"
IMAGE = f"<|vision_start|>{PAD}<|vision_end|>"
#: prompts with 0, 1 and 2 images and the images' (height, width) in pixels
PROMPTS = {
    0: ("<|im_start|>user\nNo picture here, just text.<|im_end|>\n", []),
    1: (f"<|im_start|>user\n{IMAGE}What is in it?<|im_end|>\n<|im_start|>assistant\n", [(56, 84)]),
    2: (f"Compare {IMAGE} with {IMAGE} please.", [(112, 112), (84, 56)]),
}


model_dirs, hf_models, runners = arch_checkpoint_fixtures(save_tiny_qwen2_vl, ARCHS)


def images_of(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    return [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]


def features_of(inputs: dict[str, torch.Tensor], image_token_id: int) -> list[MultiModalFeature]:
    """One feature per image of HF's ``inputs``, as the front-end makes them: the image's
    placeholder run in ``input_ids``, its rows of ``pixel_values`` and its grid row."""
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != t)]
    grids = inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    assert len(starts) == len(grids)
    features, first_patch = [], 0
    for start, grid in zip(starts, grids, strict=True):
        patches = int(grid.prod())
        tensors = {
            "pixel_values": inputs["pixel_values"][first_patch : first_patch + patches],
            "image_grid_thw": grid.view(1, 3),
        }
        features.append(make_feature("image", start, patches // 4, tensors))
        first_patch += patches
    return features


def chassis_prefill_then_decode(
    runner: Runner, inputs: dict[str, torch.Tensor], image_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our logits for the whole prompt (one prefill step, image rows in place, M-RoPE
    positions), then for one decode step of its greedy next token; and that token."""
    model = runner.model
    prompt = inputs["input_ids"][0]
    num_tokens = len(prompt)
    features = features_of(inputs, image_token_id)
    positions, delta = model.mrope_positions(prompt.tolist(), features)
    tables = allocate_block_tables([num_tokens + 1], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    kv = new_kv_caches(runner.hf_config, NUM_BLOCKS, BLOCK_SIZE)
    with torch.no_grad():
        embeds = model.embed_input_ids(prompt)
        for feature in features:
            embeds[feature.offset : feature.end] = model.embed_multimodal(
                "image", feature.tensors()
            )
        meta = make_attention_metadata([num_tokens], [num_tokens], tables, BLOCK_SIZE)
        hidden = model(prompt, torch.from_numpy(positions), ForwardContext(meta, kv), embeds)
        prefill = model.compute_logits(hidden)
        next_token = int(prefill[-1].argmax())
        meta = make_attention_metadata([1], [num_tokens + 1], tables, BLOCK_SIZE)
        hidden = model(
            torch.tensor([next_token]),
            torch.tensor([num_tokens + delta]),  # 1-D: the three components equal
            ForwardContext(meta, kv),
        )
        decode = model.compute_logits(hidden)[0]
    return prefill, decode, next_token


def assert_logits_match(
    runner: Runner, hf: Any, inputs: dict[str, torch.Tensor], image_token_id: int
) -> None:
    """Our prefill logits on HF's ``inputs`` (M-RoPE positions, image rows in place) are
    HF's forward's (1e-4), the greedy token is HF's argmax, and the decode step after it
    (position ``P + delta``) gives HF's logits on the prompt with that token appended."""
    prefill, decode, token = chassis_prefill_then_decode(runner, inputs, image_token_id)
    expected = hf_logits_with_images(hf, inputs)
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)
    assert token == int(expected[-1].argmax())
    expected_next = hf_logits_with_images(hf, extended(inputs, token))[-1]
    torch.testing.assert_close(decode, expected_next, atol=1e-4, rtol=1e-4)


def extended(inputs: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """``inputs`` with ``token`` appended (a text token)."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], dim=1)
    if "mm_token_type_ids" in inputs:
        zero = torch.zeros(1, 1, dtype=inputs["mm_token_type_ids"].dtype)
        out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], zero], dim=1)
    return out


# -- the vision tower -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "sizes",
    [[(56, 56)], [(112, 112)], [(84, 112)], [(56, 84), (112, 56)]],
    ids=["56x56", "112x112", "84x112", "two_images"],
)
def test_vision_tower_matches_transformers(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    sizes: list[tuple[int, int]],
) -> None:
    """Our tower's rows equal HF's ``visual`` module's; one call per image
    (``embed_multimodal``, as the runner calls it) gives the same rows as one call for all."""
    images = images_of(sizes, seed=len(sizes))
    inputs = hf_inputs(model_dirs[arch], " ".join([PAD] * len(images)), images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.no_grad():
        expected = hf_models[arch].model.visual(pixels, grid_thw=grid).pooler_output
        ours = runners[arch].model.visual(pixels, grid)
        per_image = [
            runners[arch].model.embed_multimodal("image", f.tensors())
            for f in features_of(inputs, hf_models[arch].config.image_token_id)
        ]
    assert ours.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(per_image), expected, atol=1e-5, rtol=1e-5)


def test_window_attention_is_exercised() -> None:
    """The fixture's 56-pixel windows (2x2 merged groups): a 112x112 image (4x4 groups) has
    4 windows of 16 patches, an 84x112 one (3x4 groups) 4 windows of 16, 16, 8, 8 patches,
    and the reordering differs from the identity (so windows are tested, not skipped)."""
    order, bounds = window_order([(1, 8, 8)], merge=2, window=2)
    assert bounds == [0, 16, 32, 48, 64]
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    _, bounds = window_order([(1, 6, 8)], merge=2, window=2)
    assert bounds == [0, 16, 32, 40, 48]


# -- M-RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_mrope_positions_match_get_rope_index(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    num_images: int,
) -> None:
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes))
    hf = hf_models[arch]
    ids = inputs["input_ids"]
    token_types = inputs.get("mm_token_type_ids", torch.zeros_like(ids, dtype=torch.int32))
    expected, expected_delta = hf.model.get_rope_index(
        ids, mm_token_type_ids=token_types, image_grid_thw=inputs.get("image_grid_thw")
    )
    features = features_of(inputs, hf.config.image_token_id)
    positions, delta = runners[arch].model.mrope_positions(ids[0].tolist(), features)
    assert positions.dtype == np.int64 and positions.shape == (3, ids.shape[1])
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    if num_images:
        assert delta < 0 and not (positions[0] == positions[1]).all()


def test_mrope_rotation_matches_transformers() -> None:
    """``[3, T]`` positions rotate q and k as HF's Qwen2-VL rotary and
    ``apply_rotary_pos_emb`` do; equal components as the 1-D (plain RoPE) path, exactly."""
    import transformers as tf
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    config = tf.Qwen2VLTextConfig(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope
    )
    ours = MRotaryEmbedding(128, 4096, rope_parameters(config))
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 128), torch.randn(7, 2, 128)
    positions = torch.tensor([[0, 5, 5, 5, 9, 10, 4000], [0, 5, 6, 6, 9, 10, 4000]])
    positions = torch.cat([positions, torch.tensor([[0, 5, 5, 6, 9, 10, 4000]])])
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions.view(3, 1, -1))
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    our_q, our_k = ours(positions, q.clone(), k.clone())
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    same = positions[0].expand(3, -1)
    three_q, three_k = ours(same, q.clone(), k.clone())
    one_q, one_k = ours.forward_reference(positions[0], q.clone(), k.clone())
    assert torch.equal(three_q, one_q) and torch.equal(three_k, one_k)


def test_a_bad_mrope_section_is_refused() -> None:
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 16]}
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(128, 64, params)


# -- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_with_images_match_transformers(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    num_images: int,
) -> None:
    """Prefill (positions ``[3, P]``, image rows in place) and the decode step after it
    (position ``P + delta``) give HF's logits."""
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes))
    hf = hf_models[arch]
    assert_logits_match(runners[arch], hf, inputs, hf.config.image_token_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_image_changes_the_logits(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
) -> None:
    """The same prompt with another image (same size, so the same tokens and positions)
    gives other logits after the image, HF's for that image: the rows are used."""
    prompt, sizes = PROMPTS[1]
    hf = hf_models[arch]
    logits = []
    for seed in (0, 10):
        inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes, seed))
        ours, _, _ = chassis_prefill_then_decode(runners[arch], inputs, hf.config.image_token_id)
        torch.testing.assert_close(ours, hf_logits_with_images(hf, inputs), atol=1e-4, rtol=1e-4)
        logits.append(ours)
    end = features_of(inputs, hf.config.image_token_id)[0].end
    assert (logits[0][end:] - logits[1][end:]).abs().max() > 1e-2


# -- weights -----------------------------------------------------------------------------------


def test_the_tower_is_read_in_both_layouts(
    model_dirs: dict[str, Path],
    runners: dict[str, Runner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Every tensor of the hub layout (``visual.*``) is read; transformers 5's in-memory
    names (``model.visual.*``, ``model.language_model.*``) load to the same parameters."""
    model_dir = model_dirs["qwen2_5_vl"]
    tensors = load_file(model_dir / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors)
    read, _ = read_tensors(model_dir, monkeypatch)
    assert read == set(tensors)

    def in_memory(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model."):
            return "model.language_model." + name.removeprefix("model.")
        return name

    renamed = tmp_path / "in_memory"
    renamed.mkdir()
    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (renamed / path.name).write_bytes(path.read_bytes())
    save_file({in_memory(n): t for n, t in tensors.items()}, renamed / "model.safetensors")
    reloaded = dict(Runner(renamed).model.named_parameters())
    for name, param in runners["qwen2_5_vl"].model.named_parameters():
        assert torch.equal(reloaded[name], param), name


# -- bad input ---------------------------------------------------------------------------------


def test_bad_image_inputs_are_clear_errors(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    model = runners["qwen2_vl"].model
    inputs = hf_inputs(model_dirs["qwen2_vl"], PAD, images_of([(56, 56)]))
    (feature,) = features_of(inputs, hf_models["qwen2_vl"].config.image_token_id)
    tensors = feature.tensors()
    with pytest.raises(ValueError, match="video inputs lack pixel_values_videos"):
        model.embed_multimodal("video", tensors)
    with pytest.raises(ValueError, match="lack image_grid_thw"):
        model.embed_multimodal("image", {"pixel_values": tensors["pixel_values"]})
    with pytest.raises(ValueError, match="pixel_values has 15 patches"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][1:]})
    with pytest.raises(ValueError, match=r"must be \[patches, 1176\]"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][:, 1:]})
    prompt = inputs["input_ids"][0].tolist()
    short = make_feature("image", feature.offset, feature.length - 1, tensors)
    with pytest.raises(ValueError, match="has 3 placeholder tokens; it needs 4"):
        model.mrope_positions(prompt, [short])
    with pytest.raises(ValueError, match="outside the prompt"):
        model.mrope_positions(prompt[:2], [feature])


def test_the_tower_runs_in_the_model_dtype(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """A bfloat16 model's image rows are bfloat16, near the float32 model's."""
    model_dir = model_dirs["qwen2_5_vl"]
    inputs = hf_inputs(model_dir, PAD, images_of([(112, 84)]))
    (feature,) = features_of(inputs, hf_models["qwen2_5_vl"].config.image_token_id)
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", feature.tensors())
        reference = runners["qwen2_5_vl"].model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=1e-2, rtol=1e-2)
