"""Mixture-of-experts: the experts' torch paths against their reference, and the Mixtral,
Qwen2-MoE and Qwen3-MoE models against HF transformers (float32, greedy, identical tokens),
on one device and over two tensor-parallel ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fixtures_models import write_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity

from chassis.builtin_plugins.models.sparse_moe import MoeSpec
from chassis.core.layers.moe import (
    FusedMoE,
    fused_experts_grouped,
    fused_experts_ref,
    select_experts,
)

ARCHES = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture
def moe_dirs(tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir) -> dict[str, Path]:
    return {
        "mixtral": tiny_mixtral_dir,
        "qwen2_moe": tiny_qwen2_moe_dir,
        "qwen3_moe": tiny_qwen3_moe_dir,
    }


# -- the layer ---------------------------------------------------------------------------------


def _experts(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 48, 24
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, True)
    return x, w13, w2, weights, ids


def test_select_experts_keeps_the_largest_probabilities() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 5.0, -1.0, 0.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 3], [1, 0]]  # largest first
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))
    assert weights.dtype == renormed.dtype == torch.float32


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (9, 8, 2), (33, 4, 4), (5, 16, 3)])
def test_grouped_experts_match_the_reference(tokens: int, experts: int, top_k: int) -> None:
    x, w13, w2, weights, ids = _experts(tokens, experts, top_k, torch.float32)
    torch.testing.assert_close(
        fused_experts_grouped(x, w13, w2, weights, ids),
        fused_experts_ref(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_grouped_experts_match_the_reference_in_bfloat16() -> None:
    x, w13, w2, weights, ids = _experts(17, 8, 2, torch.bfloat16)
    got = fused_experts_grouped(x, w13, w2, weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got, fused_experts_ref(x, w13, w2, weights.bfloat16(), ids), atol=1e-2, rtol=1e-2
    )


def test_the_reference_is_the_formula() -> None:
    """Token by token: the weighted sum of its experts' SwiGLU outputs."""
    x, w13, w2, weights, ids = _experts(6, 4, 2, torch.float64)
    out = fused_experts_ref(x, w13, w2, weights.double(), ids)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        expected = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            expected += weights[t, j].double() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected)


def test_shape_errors_name_the_shapes() -> None:
    x, w13, w2, weights, ids = _experts(3, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 48\]"):
        fused_experts_ref(x[:, :10], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="are not"):
        fused_experts_grouped(x, w13, w2[:, :, :5], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_experts_grouped(x, w13, w2, weights[:2], ids[:2])


def test_fused_moe_loads_expert_matrices_and_refuses_bad_ones() -> None:
    layer = FusedMoE(4, 2, 8, 6, renormalize=True, round_weights_to_model_dtype=False)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    assert layer.load_expert_weight(2, "gate", gate) == "2.gate"
    layer.load_expert_weight(2, "up", up)
    layer.load_expert_weight(2, "down", down)
    assert torch.equal(layer.w13[2], torch.cat([gate, up])) and torch.equal(layer.w2[2], down)
    assert len(layer.shards_needed()) == 12
    with pytest.raises(ValueError, match=r"expert 2 up weight has shape \(8, 6\), expected"):
        layer.load_expert_weight(2, "up", down)
    with pytest.raises(ValueError, match="out of range"):
        layer.load_expert_weight(4, "gate", gate)
    with pytest.raises(ValueError, match="unknown expert projection"):
        layer.load_expert_weight(0, "w9", gate)
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        FusedMoE(4, 5, 8, 6, renormalize=True, round_weights_to_model_dtype=False)


def test_which_layers_are_sparse() -> None:
    spec = MoeSpec(8, 2, 16, True, True, dense_layers=frozenset({0}), sparse_step=2)
    assert [spec.is_sparse(i) for i in range(6)] == [False, True, False, True, False, True]
    assert not MoeSpec(0, 1, 16, True, True).is_sparse(0)


# -- the models against HF ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_moe_logits_match_transformers(moe_dirs, arch: str) -> None:
    """Batched prefill, decode over the paged cache, and a chunk over a cached prefix."""
    check_parity(moe_dirs[arch], TOKEN_PROMPTS, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    "engine",
    [{"enable_prefix_caching": True}, {"max_num_batched_tokens": 16, "block_size": 4}],
    ids=["prefix-cache", "chunked-prefill"],
)
def test_tiny_moe_models_generate_hf_greedy_tokens(moe_dirs, arch: str, engine) -> None:
    model_dir = moe_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


def test_mlp_only_layers_and_sparse_step_match_transformers(tmp_path: Path) -> None:
    """Qwen3-MoE with a dense first layer and every second layer sparse (3 layers)."""
    model_dir = write_tiny_checkpoint(
        "qwen3_moe",
        tmp_path,
        seed=3,
        num_hidden_layers=4,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        norm_topk_prob=False,
    )
    runner = Runner(model_dir)
    kinds = [type(layer.mlp).__name__ for layer in runner.model.model.layers]
    assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock", "SparseMoeBlock"]
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_a_checkpoint_missing_an_expert_is_refused(tiny_qwen3_moe_dir: Path, tmp_path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_moe_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13"):
        Runner(broken)


def test_an_expert_tensor_of_the_wrong_architecture_is_refused(tiny_qwen3_dir: Path) -> None:
    """A dense Qwen3 has no experts: an expert tensor is an unknown name, not a crash."""
    model = Runner(tiny_qwen3_dir).model
    with pytest.raises(ValueError, match="no counterpart"):
        model.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(2))])


# -- tensor parallel ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_two_ranks_match_hf(moe_dirs, arch: str) -> None:
    """Each rank holds half of every expert's columns (and of the shared expert's)."""
    model_dir = moe_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected


# -- dispatch to a platform kernel, and graph capture --------------------------------------------


class _RecordingKernels:
    """Platform kernels whose ``fused_moe`` is the reference, recording its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def handles(self, x: torch.Tensor) -> bool:
        return True

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        self.calls += 1
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)


def test_a_platform_fused_moe_kernel_is_used_and_allows_graphs(
    tiny_qwen3_moe_dir: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_cuda_graphs import GraphTestPlatform, ReplayOnlyTorchPaged

    from chassis.core import config as config_module
    from chassis.core.cuda_graphs import eager_reason
    from chassis.core.layers import moe

    config = config_module.EngineConfig()
    capable = GraphTestPlatform()
    runner = Runner(tiny_qwen3_moe_dir)
    # the torch path reads expert counts on the host: decode steps stay eager
    reason = eager_reason(config, capable, ReplayOnlyTorchPaged, runner.model)
    assert reason is not None and "reads expert counts on the host" in reason
    assert eager_reason(config, capable, ReplayOnlyTorchPaged, Runner(tiny_qwen3_dir).model) is None

    expected = runner.step([TOKEN_PROMPTS[0]], [len(TOKEN_PROMPTS[0])], [list(range(8))])
    kernels = _RecordingKernels()
    monkeypatch.setattr(moe, "kernels_for", lambda x: kernels)
    assert eager_reason(config, capable, ReplayOnlyTorchPaged, runner.model) is None
    got = runner.step([TOKEN_PROMPTS[0]], [len(TOKEN_PROMPTS[0])], [list(range(8, 16))])
    assert kernels.calls == 2  # one per sparse layer
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
