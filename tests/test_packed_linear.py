"""oneDNN-packed linear weights (CPU): same values as ``F.linear``, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures_models import *  # noqa: F403
from torch import nn

from chassis import LLM, SamplingParams
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cpu_packed_linear import PackedLinear, can_pack, pack_linear_weights

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="this torch build has no oneDNN linear packing",
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from threads on the shared 2-core test machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_packed_linear_matches_f_linear(bias: bool, num_tokens: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96, dtype=torch.bfloat16)
    expected = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight  # parameters shared, not copied
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, rtol=0, atol=0)


def test_packed_linear_follows_in_place_weight_updates() -> None:
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(32, 48, bias=False).to(torch.bfloat16))
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        packed.weight.copy_(torch.randn(48, 32))
    torch.testing.assert_close(packed(x), F.linear(x, packed.weight), rtol=0, atol=0)


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
