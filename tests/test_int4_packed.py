"""4-bit AWQ/GPTQ layers kept packed (core/int4_packing.py, core/layers/int4_linear.py).

The layout's reference against the independently dequantized checkpoint weights, the bytes a
packed layer holds, and the engine on packed tiny Llama checkpoints giving the tokens of the
dequantized path (``int4_weights="dequantized"``). The Triton kernel is checked against the
reference in tests/test_triton_int4.py.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest
import torch
from test_fp8_checkpoints import NEW_TOKENS, PROMPTS
from test_int4_checkpoints import SCHEMES, Scheme, _packed_module, write_int_twins
from torch import nn

from chassis import LLM, SamplingParams
from chassis.core import model_loader
from chassis.core.config import EngineConfig
from chassis.core.int4_packing import (
    Int4Sources,
    canonical_int4,
    keeps_int4_packed,
    pack_int4_linears,
)
from chassis.core.layers import int4_linear
from chassis.core.layers.int4_linear import (
    Int4Linear,
    pack_codes,
    platform_int4_kernel,
    unpack_codes,
)
from chassis.core.packed_int_weights import packed_int_format


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_codes_inverts_unpack_codes(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (64, 24), generator=torch.Generator().manual_seed(0))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 24)
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.int32))


#: the layouts kept packed: 4-bit GPTQ (grouped, act-order, one group) and AWQ; 8-bit GPTQ
LAYOUT_SCHEMES = {
    **{
        key: SCHEMES[key]
        for key in ("gptq-4bit-g32", "gptq-4bit-act-order", "gptq-4bit-one-group", "awq-4bit-g32")
    },
    "gptq-8bit": SCHEMES["gptq-8bit"],
    "gptq-8bit-act-order": Scheme("gptq", bits=8, act_order=True),
}


@pytest.mark.parametrize("key", list(LAYOUT_SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_holds_the_checkpoint_weight(key: str, dtype: torch.dtype) -> None:
    """The canonical layout's reference matmul equals ``F.linear`` on the checkpoint's
    dequantized weight rounded to ``dtype``, bit for bit."""
    scheme = LAYOUT_SCHEMES[key]
    generator = torch.Generator().manual_seed(2)
    parts, dequantized = _packed_module(torch.randn(40, 64, generator=generator), scheme, generator)
    bias = torch.randn(40, generator=generator).to(dtype)
    layer = Int4Linear(*canonical_int4(parts, packed_int_format(scheme.config())), bias)
    assert torch.equal(layer.dequantized_weight(dtype), dequantized.to(dtype))
    x = torch.randn(5, 64, generator=generator).to(dtype)
    expected = nn.functional.linear(x, dequantized.to(dtype).contiguous(), bias)
    assert torch.equal(layer(x), expected)


def _tensor_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_packed_layer_holds_about_a_quarter_of_the_bytes() -> None:
    """A 512 -> 256 layer in groups of 128: codes, scales, zero points and g_idx against
    the bfloat16 ``nn.Linear`` it replaces."""
    scheme = Scheme("gptq", group_size=128)
    generator = torch.Generator().manual_seed(3)
    parts, dequantized = _packed_module(
        torch.randn(256, 512, generator=generator), scheme, generator
    )
    linear = nn.Linear(512, 256, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(dequantized)
    model = nn.Sequential()
    model.add_module("proj", linear)
    sources = Int4Sources(packed_int_format(scheme.config()))
    sources.record("proj", parts)
    before = _tensor_bytes(model)
    assert pack_int4_linears(model, sources, {}) == 1
    assert isinstance(model.proj, Int4Linear)
    ratio = _tensor_bytes(model) / before
    assert 0.25 < ratio < 0.28, ratio


def test_merged_projections_are_packed_in_the_order_that_reproduces_the_weight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheme = SCHEMES["gptq-4bit-g32"]
    generator = torch.Generator().manual_seed(4)
    names = ("q_proj", "k_proj", "v_proj")
    modules = {
        n: _packed_module(torch.randn(16, 64, generator=generator), scheme, generator)
        for n in names
    }
    merged = nn.Linear(64, 48, bias=False)
    with torch.no_grad():  # the model's order: q, k, v
        merged.weight.copy_(torch.cat([modules[n][1] for n in names]))
    model = nn.Module()
    model.add_module("qkv_proj", merged)
    sources = Int4Sources(packed_int_format(scheme.config()))
    for name in names:
        sources.record(name, modules[name][0])
    # declared in another order (v, k, q): the order is searched for
    declared = {n: "qkv_proj" for n in reversed(names)}
    expected = merged.weight.clone()
    assert pack_int4_linears(model, sources, declared) == 1
    assert torch.equal(model.qkv_proj.dequantized_weight(torch.float32), expected)
    assert merged.weight.numel() == 0  # the replaced layer's weight is freed
    # a layer the packed tensors do not reproduce stays as it is
    other = nn.Linear(64, 48, bias=False)
    model.add_module("qkv_proj", other)
    with caplog.at_level(logging.WARNING, logger="chassis.core.int4_packing"):
        assert pack_int4_linears(model, sources, {n: "qkv_proj" for n in names}) == 0
    assert model.qkv_proj is other
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "1 linear layers kept dequantized" in caplog.text and "qkv_proj" in caplog.text


def _greedy(path: Path, **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="bfloat16", max_model_len=64, num_kv_blocks=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)], llm


ENGINE_CASES = {
    "llama-gptq-act-order": ("tiny_llama_dir", SCHEMES["gptq-4bit-act-order"]),
    "llama-awq": ("tiny_llama_dir", SCHEMES["awq-4bit-g32"]),
    "qwen2-moe-awq": ("tiny_qwen2_moe_dir", Scheme("awq", group_size=16)),
    "llama-gptq-8bit": ("tiny_llama_dir", SCHEMES["gptq-8bit"]),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_packed_checkpoint_gives_the_dequantized_paths_tokens(
    request: pytest.FixtureRequest, tmp_path: Path, case: str
) -> None:
    fixture, scheme = ENGINE_CASES[case]
    quantized, _, _ = write_int_twins(request.getfixturevalue(fixture), tmp_path, scheme)
    expected, llm = _greedy(quantized, int4_weights="dequantized")
    model = llm.engine.executor.worker.runner.model
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    dense_bytes = _tensor_bytes(model.model.layers)
    del llm, model
    gc.collect()
    got, llm = _greedy(quantized, int4_weights="packed")
    model = llm.engine.executor.worker.runner.model
    packed = {
        name.split(".", 3)[3] for name, m in model.named_modules() if isinstance(m, Int4Linear)
    }
    if case in ("llama-awq", "llama-gptq-8bit"):  # every decoder projection
        assert packed == {
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        }
    elif case == "llama-gptq-act-order":
        # the checkpoint here gives q, k and v (gate and up) different random g_idx, so the
        # merged layers stay dequantized (GPTQ's own act-order takes one order from their
        # shared input); o and down are packed
        assert packed == {"self_attn.o_proj", "mlp.down_proj"}
    else:  # attention and the shared expert; the fused experts stay dequantized
        assert {"self_attn.qkv_proj", "self_attn.o_proj"} <= packed
        assert any("shared_expert." in name for name in packed), packed
        assert not any(".experts." in name for name in packed), packed
    assert _tensor_bytes(model.model.layers) < dense_bytes
    assert got == expected


def test_act_order_projections_sharing_g_idx_are_packed_merged() -> None:
    """Q, K and V quantized in one act-order (their shared input's): the merged layer packs."""
    scheme = SCHEMES["gptq-4bit-act-order"]
    generator = torch.Generator().manual_seed(5)
    whole, dequantized = _packed_module(torch.randn(48, 64, generator=generator), scheme, generator)
    names = ("q_proj", "k_proj", "v_proj")
    sources = Int4Sources(packed_int_format(scheme.config()))
    for i, name in enumerate(names):  # 16 output columns each: 2 int32 of zero points
        sources.record(
            name,
            {
                "qweight": whole["qweight"][:, 16 * i : 16 * (i + 1)],
                "qzeros": whole["qzeros"][:, 2 * i : 2 * (i + 1)],
                "scales": whole["scales"][:, 16 * i : 16 * (i + 1)],
                "g_idx": whole["g_idx"],
            },
        )
    merged = nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        merged.weight.copy_(dequantized)
    model = nn.Module()
    model.add_module("qkv_proj", merged)
    assert pack_int4_linears(model, sources, {n: "qkv_proj" for n in names}) == 1
    x = torch.randn(3, 64, generator=generator).bfloat16()
    assert torch.equal(model.qkv_proj(x), nn.functional.linear(x, dequantized.bfloat16()))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("key", ["gptq-4bit-act-order", "awq-4bit-g32"])
def test_tensor_parallel_shares_are_packed(key: str, rank: int) -> None:
    """Two ranks: a column-parallel layer holds its half of the output columns, a
    row-parallel one its half of the 96 input rows (48: mid-group for groups of 32)."""
    scheme = SCHEMES[key]
    generator = torch.Generator().manual_seed(6)
    column, column_w = _packed_module(torch.randn(48, 96, generator=generator), scheme, generator)
    row, row_w = _packed_module(torch.randn(40, 96, generator=generator), scheme, generator)
    model = nn.Module()
    model.add_module("up", nn.Linear(96, 24, bias=False))
    model.add_module("down", nn.Linear(48, 40, bias=False))
    with torch.no_grad():
        model.up.weight.copy_(column_w[24 * rank : 24 * (rank + 1)])
        model.down.weight.copy_(row_w[:, 48 * rank : 48 * (rank + 1)])
    sources = Int4Sources(packed_int_format(scheme.config()))
    sources.record("up", column)
    sources.record("down", row)
    expected = {name: m.weight.clone() for name, m in model.named_children()}
    assert pack_int4_linears(model, sources, {}, tp_size=2, tp_rank=rank) == 2
    for name, layer in model.named_children():
        assert isinstance(layer, Int4Linear)
        assert torch.equal(layer.dequantized_weight(torch.float32), expected[name])
    assert model.down.in_features == 48 and model.up.out_features == 24


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_packed_awq_under_tensor_parallelism(
    tiny_llama_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Two ranks each pack all 8 of their layers (the second rank logs it from its worker
    process) and give the tokens of two ranks on the dequantized weights."""
    caplog.set_level(logging.INFO)  # the rank processes log at the parent's level
    quantized, _, _ = write_int_twins(tiny_llama_dir, tmp_path, SCHEMES["awq-4bit-g32"])
    expected, llm = _greedy(quantized, tensor_parallel_size=2, int4_weights="dequantized")
    llm.shutdown()
    del llm
    gc.collect()
    got, llm = _greedy(quantized, tensor_parallel_size=2, int4_weights="packed")
    llm.shutdown()
    assert "[tp1] chassis.core.model_loader: int4: 8 linear layers keep" in capfd.readouterr().err
    assert got == expected


def test_the_layer_runs_the_platforms_kernel_when_it_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Int4Linear`` asks the platform's layer kernels for ``int4_linear``; kernels
    without it (the CPU's) leave the reference."""
    scheme = SCHEMES["gptq-4bit-g32"]
    generator = torch.Generator().manual_seed(7)
    parts, dequantized = _packed_module(torch.randn(8, 64, generator=generator), scheme, generator)
    layer = Int4Linear(*canonical_int4(parts, packed_int_format(scheme.config())), None)
    x = torch.randn(2, 64, generator=generator)
    calls: list[tuple[int, ...]] = []

    class WithKernel:
        def int4_linear(self, x, qweight, scales, zeros, g_idx, bias):
            calls.append(tuple(qweight.shape))
            return torch.zeros(*x.shape[:-1], 8)

    monkeypatch.setattr(int4_linear, "kernels_for", lambda _x: WithKernel())
    assert torch.equal(layer(x), torch.zeros(2, 8)) and calls == [(8, 8)]
    monkeypatch.setattr(int4_linear, "kernels_for", lambda _x: object())
    assert torch.equal(layer(x), nn.functional.linear(x, dequantized.contiguous()))


def test_auto_packs_only_where_the_platform_has_an_int4_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--int4-weights auto`` (the default): the CPU platform's kernels lack ``int4_linear``
    (its reference dequantizes every weight on every call), so a 4-bit checkpoint loads
    dequantized; a platform whose kernels have it keeps the codes packed. ``packed`` and
    ``dequantized`` do what they say whatever the platform."""
    hf_config = type("Config", (), {"quantization_config": SCHEMES["awq-4bit-g32"].config()})()
    assert EngineConfig().int4_weights == "auto"
    assert platform_int4_kernel() is None
    assert model_loader._int4_sources(EngineConfig(), hf_config) is None
    assert isinstance(
        model_loader._int4_sources(EngineConfig(int4_weights="packed"), hf_config), Int4Sources
    )

    class WithKernel:
        def int4_linear(self, *args: object) -> None: ...

    class PlatformWithKernel:
        def layer_kernels(self) -> WithKernel:
            return WithKernel()

    monkeypatch.setattr(int4_linear, "get_current_platform", PlatformWithKernel)
    assert platform_int4_kernel() is not None
    assert isinstance(model_loader._int4_sources(EngineConfig(), hf_config), Int4Sources)
    # compiled models trace the layers' torch code, where the kernel does not run
    assert model_loader._int4_sources(EngineConfig(torch_compile=True), hf_config) is None
    assert not keeps_int4_packed("dequantized")
    monkeypatch.setattr(int4_linear.layer_kernels, "ENABLED", False)  # CHASSIS_LAYER_KERNELS=0
    assert not keeps_int4_packed("auto") and keeps_int4_packed("packed")
    with pytest.raises(ValueError, match="--int4-weights must be one of auto, packed"):
        EngineConfig(int4_weights="int4").validate()


def test_the_layer_holds_contiguous_packed_tensors() -> None:
    """Column views of wider tensors (a rank's share, one projection of a merged module) are
    copied: the Triton kernel indexes ``qweight``, ``scales`` and ``zeros`` with unit column
    strides, so a strided view would read other columns."""
    scheme = SCHEMES["gptq-4bit-g32"]
    generator = torch.Generator().manual_seed(8)
    parts, dequantized = _packed_module(torch.randn(16, 64, generator=generator), scheme, generator)
    qweight, scales, zeros, g_idx = canonical_int4(parts, packed_int_format(scheme.config()))
    views = (qweight[:, 8:], scales[:, 8:], zeros[:, 8:], g_idx)
    assert not views[0].is_contiguous()
    layer = Int4Linear(*views, None)
    assert all(b.is_contiguous() for b in (layer.qweight, layer.scales, layer.zeros))
    assert torch.equal(layer.dequantized_weight(torch.float32), dequantized[8:])


def test_8bit_gptq_is_kept_packed_and_2bit_is_not(caplog: pytest.LogCaptureFixture) -> None:
    """8-bit GPTQ codes stay packed (4 per int32, the same layout and kernel); 2-bit ones
    load dequantized, with a log line saying why."""
    caplog.set_level(logging.INFO, logger="chassis.core.model_loader")
    for key, kept in (("gptq-8bit", True), ("gptq-2bit-act-order", False)):
        hf_config = type("Config", (), {"quantization_config": SCHEMES[key].config()})()
        sources = model_loader._int4_sources(EngineConfig(int4_weights="packed"), hf_config)
        assert isinstance(sources, Int4Sources) == kept, key
    assert "2-bit codes (4-bit and 8-bit GPTQ are kept packed)" in caplog.text
