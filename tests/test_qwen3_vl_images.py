"""Qwen3-VL and Qwen3-VL-MoE with images against HF transformers on tiny random checkpoints.

tests/fixtures_qwen3_vl.py writes each checkpoint (2 text layers; a 2-block vision tower with
a deepstack merger on each block, a 4x4 learned position grid; Qwen3-VL's preprocessor
config). Checked here, float32: the tower's rows and deepstack rows equal HF's ``visual``
module's (one image, two of different sizes in one call); ``mrope_positions`` equals HF's
Qwen3-VL ``get_rope_index`` for 0, 1 and 2 images; interleaved M-RoPE equals HF's rotation;
a prefill with images and the decode step after it give HF's logits (and without the
deepstack rows they would not); another image changes the logits; through ``LLM``:
greedy tokens and each token's logprob equal HF ``generate``'s (a batch of one image, two
images and text), with chunked prefill cutting through an image, for ``LLM.chat`` with
an image part, with a LoRA adapter, and on two tensor-parallel ranks; bad image inputs are
clear errors.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from fixtures_qwen2_vl import hf_inputs, random_image
from fixtures_qwen3_vl import ARCHS, save_tiny_qwen3_vl
from mm_hf_compare import (
    arch_checkpoint_fixtures,
    read_tensors,
)
from safetensors.torch import load_file
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner
from test_multimodal_engine import chat_prompt, generate, hf_answer, vl_llm
from test_qwen2_vl_images import (
    assert_logits_match,
    chassis_prefill_then_decode,
    features_of,
    hf_logits_with_images,
)

from chassis.core.attention import ForwardContext
from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.layers.rotary import rope_parameters

PAD = "<|image_pad|>"
IMAGE = f"<|vision_start|>{PAD}<|vision_end|>"
#: prompts with 0, 1 and 2 images and the images' (height, width) in pixels (patch 16,
#: merge 2: 64x96 is a 4x6 patch grid, 6 tokens; 128x128 is 8x8, 16 tokens)
PROMPTS = {
    0: ("<|im_start|>user\nNo picture here, just text.<|im_end|>\n", []),
    1: (f"<|im_start|>user\n{IMAGE}What is in it?<|im_end|>\n<|im_start|>assistant\n", [(64, 96)]),
    2: (f"Compare {IMAGE} with {IMAGE} please.", [(128, 128), (96, 64)]),
}
IMAGE_TOKEN_ID = 49154  # <|image_pad|> in the tiny checkpoints' tokenizer


model_dirs, hf_models, runners = arch_checkpoint_fixtures(save_tiny_qwen3_vl, ARCHS)


def images_of(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    return [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]


# -- the vision tower -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "sizes", [[(64, 96)], [(128, 128), (96, 64)]], ids=["one_image", "two_images"]
)
def test_vision_tower_matches_transformers(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    sizes: list[tuple[int, int]],
) -> None:
    """The merger's rows and each deepstack set's equal HF's ``visual`` module's (the
    position table resampled to 4x6 and 8x8 grids); ``embed_multimodal`` per image gives
    them side by side, as wide as ``embed_input_ids``' rows."""
    images = images_of(sizes, seed=len(sizes))
    inputs = hf_inputs(model_dirs[arch], " ".join([PAD] * len(images)), images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    model = runners[arch].model
    with torch.no_grad():
        expected = hf_models[arch].model.visual(pixels, grid_thw=grid)
        rows, deepstack = model.visual(pixels, grid)
        per_image = [
            model.embed_multimodal("image", f.tensors())
            for f in features_of(inputs, IMAGE_TOKEN_ID)
        ]
        token_rows = model.embed_input_ids(torch.tensor([5, 6]))
    assert rows.shape == expected.pooler_output.shape == (int(grid.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(rows, expected.pooler_output, atol=1e-5, rtol=1e-5)
    assert len(deepstack) == len(expected.deepstack_features) == 2
    for ours, theirs in zip(deepstack, expected.deepstack_features, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    side_by_side = torch.cat([expected.pooler_output, *expected.deepstack_features], dim=-1)
    torch.testing.assert_close(torch.cat(per_image), side_by_side, atol=1e-5, rtol=1e-5)
    assert token_rows.shape == (2, 3 * 64) and not token_rows[:, 64:].any()


def test_every_checkpoint_tensor_is_read(model_dirs: dict[str, Path], monkeypatch) -> None:
    """The tower (``model.visual.*``, deepstack mergers included) is read with the rest."""
    tensors = load_file(model_dirs["qwen3_vl"] / "model.safetensors")
    assert any(name.startswith("model.visual.deepstack_merger_list.") for name in tensors)
    read, _ = read_tensors(model_dirs["qwen3_vl"], monkeypatch)
    assert read == set(tensors)


# -- M-RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_mrope_positions_match_get_rope_index(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    num_images: int,
) -> None:
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs["qwen3_vl"], prompt, images_of(sizes))
    ids = inputs["input_ids"]
    token_types = inputs.get("mm_token_type_ids", torch.zeros_like(ids, dtype=torch.int32))
    expected, expected_delta = hf_models["qwen3_vl"].model.get_rope_index(
        ids, mm_token_type_ids=token_types, image_grid_thw=inputs.get("image_grid_thw")
    )
    features = features_of(inputs, IMAGE_TOKEN_ID)
    positions, delta = runners["qwen3_vl"].model.mrope_positions(ids[0].tolist(), features)
    assert positions.dtype == np.int64 and positions.shape == (3, ids.shape[1])
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    if num_images:
        assert delta < 0 and not (positions[0] == positions[1]).all()


def test_interleaved_mrope_rotation_matches_transformers() -> None:
    """``[3, T]`` positions rotate q and k as HF's Qwen3-VL rotary (interleaved sections
    ``[24, 20, 20]``, head_dim 128) and ``apply_rotary_pos_emb`` do; equal components as the
    1-D path, exactly."""
    import transformers as tf
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    rope = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    }
    config = tf.Qwen3VLTextConfig(
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        rope_parameters=rope,
    )
    ours = MRotaryEmbedding(128, 4096, rope_parameters(config))
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 128), torch.randn(7, 2, 128)
    positions = torch.tensor(
        [[0, 5, 5, 5, 9, 10, 4000], [0, 5, 6, 6, 9, 10, 4000], [0, 5, 5, 6, 9, 11, 4000]]
    )
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(q, positions.view(3, 1, -1))
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    our_q, our_k = ours(positions, q.clone(), k.clone())
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    same = positions[0].expand(3, -1)
    three_q, three_k = ours(same, q.clone(), k.clone())
    one_q, one_k = ours.forward_reference(positions[0], q.clone(), k.clone())
    assert torch.equal(three_q, one_q) and torch.equal(three_k, one_k)
    # the other layout (Qwen2-VL's consecutive sections) turns these positions otherwise
    sections = MRotaryEmbedding(128, 4096, {**rope, "mrope_interleaved": False})
    assert not torch.allclose(sections(positions, q.clone(), k.clone())[0], our_q)


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
    """Prefill (positions ``[3, P]``, image and deepstack rows in place) and the decode step
    after it (position ``P + delta``) give HF's logits."""
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes))
    hf = hf_models[arch]
    assert_logits_match(runners[arch], hf, inputs, IMAGE_TOKEN_ID)


def test_the_deepstack_rows_and_the_image_matter(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """Without the deepstack columns the logits after the image leave HF's; another image
    (same size: same tokens and positions) gives other logits, HF's for it."""
    prompt, sizes = PROMPTS[1]
    model = runners["qwen3_vl"].model
    logits = []
    for seed in (0, 10):
        inputs = hf_inputs(model_dirs["qwen3_vl"], prompt, images_of(sizes, seed))
        ours, _, _ = chassis_prefill_then_decode(runners["qwen3_vl"], inputs, IMAGE_TOKEN_ID)
        expected = hf_logits_with_images(hf_models["qwen3_vl"], inputs)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        logits.append(ours)
    (feature,) = features_of(inputs, IMAGE_TOKEN_ID)
    assert (logits[0][feature.end :] - logits[1][feature.end :]).abs().max() > 1e-2

    prompt_ids = inputs["input_ids"][0]
    positions, _ = model.mrope_positions(prompt_ids.tolist(), [feature])
    tables = allocate_block_tables([len(prompt_ids)], BLOCK_SIZE, NUM_BLOCKS, torch.Generator())
    kv = new_kv_caches(runners["qwen3_vl"].hf_config, NUM_BLOCKS, BLOCK_SIZE)
    with torch.no_grad():
        embeds = model.embed_input_ids(prompt_ids)
        embeds[feature.offset : feature.end, :64] = model.embed_multimodal(
            "image", feature.tensors()
        )[:, :64]
        meta = make_attention_metadata([len(prompt_ids)], [len(prompt_ids)], tables, BLOCK_SIZE)
        ctx = ForwardContext(meta, kv)
        hidden = model(prompt_ids, torch.from_numpy(positions), ctx, embeds)
        without = model.compute_logits(hidden)
    assert (without[feature.end :] - expected[feature.end :]).abs().max() > 1e-2


# -- through the engine -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_images_match_hf_through_llm(model_dirs: dict[str, Path], arch: str) -> None:
    """One image, two images, and a text prompt in one ``LLM.generate`` batch: HF
    ``generate``'s greedy tokens and their logprobs (1e-4) each."""
    model_dir = model_dirs[arch]
    cases = {
        "one": (chat_prompt("Describe it.", 1), images_of([(128, 128)], seed=1)),
        "two": (chat_prompt("Compare them.", 2), images_of([(64, 96), (96, 64)], seed=2)),
        "text": (chat_prompt("Tell me a story.", 0), []),
    }
    llm = vl_llm(model_dir)
    try:
        got = generate(llm, list(cases.values()))
    finally:
        llm.shutdown()
    for (name, (prompt, case_images)), result in zip(cases.items(), got, strict=True):
        result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), name)


def test_chunked_prefill_through_an_image(model_dirs: dict[str, Path]) -> None:
    """Steps of 8 tokens cut the 16-token image (and its deepstack rows) in three: HF's
    answer; the image is encoded once."""
    model_dir = model_dirs["qwen3_vl"]
    prompt = chat_prompt("What is in this picture?", 1, before="Look here:")
    images = images_of([(128, 128)], seed=5)
    llm = vl_llm(model_dir, block_size=4, max_num_batched_tokens=8)
    runner = llm.engine.executor.worker.runner
    try:
        [result] = generate(llm, [(prompt, images)])
        assert runner.mm.num_encoder_runs == 1
    finally:
        llm.shutdown()
    image_start = result.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert image_start % 8 != 0 and result.prompt_token_ids.count(IMAGE_TOKEN_ID) == 16
    result.answer.assert_matches(hf_answer(model_dir, prompt, images), "chunked")


def test_chat_with_an_image_part(model_dirs: dict[str, Path]) -> None:
    """``LLM.chat`` with an ``image_pil`` part: the chat template's prompt, HF's answer."""
    from chassis import SamplingParams

    model_dir = model_dirs["qwen3_vl"]
    [image] = images_of([(96, 64)], seed=7)
    content = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Describe."}]
    messages = [{"role": "user", "content": content}]
    llm = vl_llm(model_dir)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        [output] = llm.chat(messages, params)
    finally:
        llm.shutdown()
    prompt = chat_prompt("Describe.", 1)
    assert output.prompt == prompt
    expected = hf_answer(model_dir, prompt, [image])
    completion = output.outputs[0]
    assert list(completion.token_ids) == expected.tokens
    chosen = [s[t].logprob for s, t in zip(completion.logprobs, completion.token_ids, strict=True)]
    np.testing.assert_allclose(chosen, expected.logprobs, atol=1e-4)


def test_lora_adapter_with_an_image(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An adapter trained on the language model (``model.language_model.layers.*``, the
    checkpoint's names) with an image: HF's answer with the adapter merged; the tower has
    no adaptable module."""
    import transformers as tf
    from safetensors.torch import save_file

    from chassis.core.lora.request import LoRARequest

    model_dir = model_dirs["qwen3_vl"]
    hf = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    rank, alpha = 8, 16
    tensors = {}
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            name = f"model.language_model.layers.{layer}.{module}"
            linear = hf.get_submodule(name)
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.2
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.2
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            with torch.no_grad():
                linear.weight += alpha / rank * (b @ a)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha}
    config["target_modules"] = ["q_proj", "v_proj", "down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))

    prompt, images = chat_prompt("Describe it.", 1), images_of([(64, 96)], seed=3)
    llm = vl_llm(model_dir, enable_lora=True, max_lora_rank=rank)
    try:
        model = llm.engine.executor.worker.runner.model
        tower = [n for n, m in model.named_modules() if n.startswith("visual.")]
        assert tower and not any(model.lora_slices(n, model.get_submodule(n)) for n in tower)
        lora = LoRARequest("adapter", 1, str(tmp_path))
        base, adapted = generate(llm, [(prompt, images)] * 2, lora_request=[None, lora])
    finally:
        llm.shutdown()
    base.answer.assert_matches(hf_answer(model_dir, prompt, images), "base")
    adapted.answer.assert_matches(hf_answer(model_dir, prompt, images, model=hf), "adapter")
    assert adapted.answer.tokens != base.answer.tokens


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(model_dirs: dict[str, Path]) -> None:
    """Qwen3-VL-MoE on two ranks, each running the whole tower, chunks of 8 tokens through
    the images: HF's answers."""
    from test_tensor_parallel import wait_for_no_workers

    model_dir = model_dirs["qwen3_vl_moe"]
    cases = [
        (chat_prompt("Describe it.", 1), images_of([(128, 128)], seed=8)),
        (chat_prompt("Compare them.", 2), images_of([(96, 64), (64, 96)], seed=9)),
    ]
    llm = vl_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4)
    try:
        got = generate(llm, cases)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    wait_for_no_workers()
    for (prompt, case_images), result in zip(cases, got, strict=True):
        result.answer.assert_matches(hf_answer(model_dir, prompt, case_images), prompt)


# -- bad input ---------------------------------------------------------------------------------


def test_bad_image_inputs_are_clear_errors(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    model = runners["qwen3_vl_moe"].model
    inputs = hf_inputs(model_dirs["qwen3_vl_moe"], PAD, images_of([(64, 64)]))
    (feature,) = features_of(inputs, IMAGE_TOKEN_ID)
    tensors = feature.tensors()
    with pytest.raises(ValueError, match="video inputs lack placeholder_ids"):
        model.embed_multimodal("video", tensors)
    with pytest.raises(ValueError, match="pixel_values has 15 patches"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][1:]})
    with pytest.raises(ValueError, match=r"must be \[patches, 1536\]"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][:, 1:]})
    with pytest.raises(ValueError, match="inputs_embeds of width 128"):
        embeds = torch.zeros(len(inputs["input_ids"][0]), 128)
        model(inputs["input_ids"][0], torch.zeros(embeds.shape[0], dtype=torch.long), None, embeds)


def test_the_tower_runs_in_the_model_dtype(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    """A bfloat16 model's image rows (deepstack columns included) are bfloat16, near the
    float32 model's."""
    model_dir = model_dirs["qwen3_vl"]
    inputs = hf_inputs(model_dir, PAD, images_of([(96, 128)]))
    (feature,) = features_of(inputs, IMAGE_TOKEN_ID)
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", feature.tensors())
        reference = runners["qwen3_vl"].model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16 and rows.shape == reference.shape == (12, 3 * 64)
    torch.testing.assert_close(rows.float(), reference, atol=2e-2, rtol=2e-2)
