"""Packed linear weights (CPU): oneDNN's layout (same values as ``F.linear``) or the chassis
bf16 kernel's (``F.linear``'s values up to rare one-step roundings); same greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chassis import LLM, SamplingParams
from chassis.platforms import cpu_packed_linear
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cpu_packed_linear import PackedLinear, can_pack, pack_linear_weights

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="this torch build has no oneDNN linear packing",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_packed_linear_matches_f_linear(bias: bool, num_tokens: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96, dtype=torch.bfloat16)
    expected = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight  # parameters shared, not copied
    assert "packed=oneDNN" in repr(packed)  # 160 outputs: not a multiple of 64
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, rtol=0, atol=0)


def _within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs of float32 sums taken in another order: rare one-step differences."""
    assert (actual != expected).float().mean().item() < 1e-2
    torch.testing.assert_close(actual, expected, rtol=2**-7, atol=2**-7)


chassis_kernel = pytest.mark.skipif(
    cpu_packed_linear._chassis_linear_ops() is None,
    reason="the chassis bf16 linear needs the compiled CPU kernels and AVX512-BF16",
)


@chassis_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 6, 7, 13, 64])  # micro-kernel rows: 6 + tails
@pytest.mark.parametrize(("out_features", "in_features"), [(128, 96), (192, 1536)])
def test_chassis_kernel_matches_f_linear(bias, num_tokens, out_features, in_features) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, num_tokens, in_features, dtype=torch.bfloat16)  # leading dims kept
    packed = PackedLinear(linear)
    assert "packed=chassis" in repr(packed)
    with torch.inference_mode():
        _within_one_rounding(packed(x), F.linear(x, linear.weight, linear.bias))


@chassis_kernel
def test_weights_the_chassis_kernel_cannot_take_go_to_onednn() -> None:
    for out_features, in_features in [(96, 64), (128, 33), (64, 8192)]:
        linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
        assert "packed=oneDNN" in repr(PackedLinear(linear)), (out_features, in_features)


@pytest.mark.parametrize("out_features", [48, 64])  # oneDNN's layout, the chassis kernel's
def test_packed_linear_follows_in_place_weight_updates(out_features: int) -> None:
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(32, out_features, bias=False).to(torch.bfloat16))
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        packed.weight.copy_(torch.randn(out_features, 32))
    _within_one_rounding(packed(x), F.linear(x, packed.weight))


def test_pack_linear_weights_skips_float32_and_keeps_parameter_names() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    names = [name for name, _ in model.named_parameters()]
    assert pack_linear_weights(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)
    assert [name for name, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="cannot pack"):
        PackedLinear(nn.Linear(4, 4))


def _greedy_tokens(model_dir, monkeypatch: pytest.MonkeyPatch, packed: bool) -> list[list[int]]:
    with monkeypatch.context() as patch:
        if not packed:
            patch.setattr(CpuPlatform, "prepare_model", lambda self, model: None)
        llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    runner = llm.engine.executor.worker.runner
    heads = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    # 2 layers x (qkv, o, gate_up, down) + the LM head (tied or not)
    assert len(heads) == (9 if packed else 0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(["Hello there", "The capital of France is", "1 2 3"], params)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_packed_engine_gives_the_same_greedy_tokens(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU platform packs by default; an unpacked engine must produce the same tokens."""
    model_dir = request.getfixturevalue(fixture)  # untied (llama) and tied (qwen2) heads
    assert _greedy_tokens(model_dir, monkeypatch, packed=True) == _greedy_tokens(
        model_dir, monkeypatch, packed=False
    )
