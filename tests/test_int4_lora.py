"""LoRA adapters over 4-bit layers kept packed (``Int4Linear`` wrapped by ``LoRALinear``).

The base projection runs the packed layer (on the CPU its reference, which gives the
dequantized weight's results exactly), the adapters' deltas are added as for any other base
layer; so the greedy tokens of a batch mixing two adapters and the base model equal those of
``--int4-weights dequantized`` with the same adapters, and HF transformers' on the
dequantized twin with each adapter merged into its weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fixtures_lora import (
    greedy_with_adapters,
    hf_greedy,
    hf_merged_model,
    lora_engine,
    write_peft_adapter,
)
from test_int4_checkpoints import SCHEMES, _packed_module, write_int_twins

from chassis import LLM
from chassis.core.int4_packing import canonical_int4
from chassis.core.layers.int4_linear import Int4Linear
from chassis.core.lora import LoRARequest
from chassis.core.lora.layers import LoRALinear, LoRAStepState
from chassis.core.packed_int_weights import packed_int_format

NEW_TOKENS = 10
PROMPTS = [
    [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033, 77, 5, 811, 64, 90],
    [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033, 77, 5, 811, 64, 3001, 12],
]
#: every packed projection of the tiny Llama's decoder layers (AWQ packs them all merged)
PACKED_LAYERS = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def test_lora_over_a_packed_layer_matches_merged_weights_per_token() -> None:
    """The wrapper over ``Int4Linear``: each token gets ``x (W + B A)^T`` of its own slot
    (or ``x W^T``), ``W`` the packed layer's dequantized weight."""
    generator = torch.Generator().manual_seed(0)
    scheme = SCHEMES["gptq-4bit-act-order"]
    parts, weight = _packed_module(torch.randn(24, 64, generator=generator), scheme, generator)
    bias = torch.randn(24, generator=generator)
    base = Int4Linear(*canonical_int4(parts, packed_int_format(scheme.config())), bias)
    state = LoRAStepState(torch.zeros(8, 2))
    layer = LoRALinear(base, [(0, 16), (16, 8)], state, max_loras=2, max_rank=4)
    deltas = {}
    for slot, rank in ((0, 4), (1, 2)):
        a0, b0 = (
            torch.randn(rank, 64, generator=generator),
            torch.randn(16, rank, generator=generator),
        )
        a1, b1 = (
            torch.randn(rank, 64, generator=generator),
            torch.randn(8, rank, generator=generator),
        )
        layer.set_slot(slot, 0, a0, b0)
        layer.set_slot(slot, 1, a1, b1)
        deltas[slot] = torch.cat([b0 @ a0, b1 @ a1])
    x = torch.randn(4, 64, generator=generator)
    token_slots = [1, -1, 0, 1]
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            state.token_mask[t, slot] = 1.0
    state.active = True
    with torch.no_grad():
        got = layer(x)
        for t, slot in enumerate(token_slots):
            merged = weight + (deltas[slot] if slot >= 0 else 0)
            torch.testing.assert_close(got[t], x[t] @ merged.T + bias)


def _engine(path: Path, **kwargs: object) -> LLM:
    return lora_engine(path, max_model_len=64, num_kv_blocks=32, max_loras=2, **kwargs)


def _greedy(llm: LLM, loras: list[LoRARequest | None], prompts: list[list[int]]) -> list:
    return greedy_with_adapters(llm, loras, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def awq_llama(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Llama in AWQ, two adapters for it (written against its dequantized twin:
    the same module names and shapes) and a batch mixing them with the base model."""
    root = tmp_path_factory.mktemp("int4_lora")
    quantized, twin, _ = write_int_twins(tiny_llama_dir, root, SCHEMES["awq-4bit-g32"])
    first = write_peft_adapter(root / "first", twin, rank=8, alpha=16, seed=1)
    second = write_peft_adapter(
        root / "second", twin, rank=4, alpha=8, use_rslora=True,
        targets=("q_proj", "v_proj", "down_proj"), seed=2,
    )  # fmt: skip
    adapters = {"first": first, "second": second, "base": None}
    names = ["first", "second", "base", "second", "first", "base"]
    return {
        "quantized": quantized,
        "twin": twin,
        "names": names,
        "loras": [
            None
            if name == "base"
            else LoRARequest(name, 1 + (name == "second"), str(adapters[name]))
            for name in names
        ],
        "prompts": [PROMPTS[i % 2] for i in range(len(names))],
        "adapters": adapters,
    }


def test_packed_base_with_adapters_gives_the_dequantized_paths_and_hfs_tokens(
    awq_llama: dict,
) -> None:
    """Two adapters and adapter-less requests in one batch: every layer packed and wrapped,
    the tokens those of ``--int4-weights dequantized`` with the same adapters, and of HF on
    the dequantized twin with each adapter merged."""
    loras, prompts = awq_llama["loras"], awq_llama["prompts"]
    llm = _engine(awq_llama["quantized"], int4_weights="packed")
    model = llm.engine.executor.worker.runner.model
    wrapped = {
        name.split(".", 3)[3]
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear) and isinstance(m.base_layer, Int4Linear)
    }
    assert wrapped == PACKED_LAYERS
    got = _greedy(llm, loras, prompts)
    # again over the prefix cache, in the other order
    assert _greedy(llm, loras[::-1], prompts[::-1]) == got[::-1]
    del llm, model
    dequantized = _engine(awq_llama["quantized"], int4_weights="dequantized")
    model = dequantized.engine.executor.worker.runner.model
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert _greedy(dequantized, loras, prompts) == got
    del dequantized, model
    twin = awq_llama["twin"]
    references = {name: hf_merged_model(twin, path) for name, path in awq_llama["adapters"].items()}
    expected = [
        hf_greedy(references[name], prompt, NEW_TOKENS)
        for name, prompt in zip(awq_llama["names"], prompts, strict=True)
    ]
    assert got == expected
    # the adapters change the tokens (else the comparison could not fail)
    assert len({tuple(got[0]), tuple(got[1]), tuple(got[2])}) == 3


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_packed_base_with_adapters_under_tensor_parallelism(awq_llama: dict) -> None:
    """Two ranks, each holding its packed share of every layer and its part of each
    adapter: the tokens of one device."""
    loras, prompts = awq_llama["loras"][:3], awq_llama["prompts"][:3]
    single = _engine(awq_llama["quantized"], int4_weights="packed")
    expected = _greedy(single, loras, prompts)
    del single
    llm = _engine(awq_llama["quantized"], int4_weights="packed", tensor_parallel_size=2)
    try:
        assert _greedy(llm, loras, prompts) == expected
    finally:
        llm.shutdown()
