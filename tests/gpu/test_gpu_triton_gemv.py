"""The small-batch Triton GEMV (core/layers/triton_gemv.py) on a real GPU, at Qwen3-0.6B's
linear layers (q/k/v 1024 -> 4096, o_proj 2048 -> 1024, gate/up 1024 -> 6144, down
3072 -> 1024, the tied LM head 1024 -> 151,936), 1, 2, 4 and 8 rows, against ``gemv_ref``;
every launch path (split-K or not, dot or multiply-and-reduce); the split path's ticket
counters over many back-to-back launches; and layers swapped by ``CHASSIS_TRITON_GEMV=1``
captured in a CUDA graph and replayed with new inputs. Run by tests/gpu/run_gpu_checks.sh
(the pytest step); the timings are tests/gpu/bench_triton_gemv.py's (the ``gemv`` group).
Also the launches with SwiGLU's activation and with the post-attention norm folded in.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
#: (in, out)
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]
#: about two roundings of the output dtype at O(1) outputs (float32 sums in another order)
TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-4}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _tensors(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, in_features, device="cuda", generator=g).to(dtype)
    weight = torch.randn(out_features, in_features, device="cuda", generator=g)
    bias = torch.randn(out_features, device="cuda", generator=g).to(dtype)
    return x, (weight / in_features**0.5).to(dtype), bias


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_reference_at_qwen3_shapes(shape: tuple[int, int], rows: int) -> None:
    from chassis.core.layers.triton_gemv import gemv, gemv_ref

    x, weight, bias = _tensors(rows, *shape, torch.bfloat16)
    _close(gemv(x, weight), gemv_ref(x, weight))
    _close(gemv(x, weight, bias), gemv_ref(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 8])
def test_swiglu_input_at_the_down_projection(rows: int) -> None:
    """``silu_and_mul=True`` at Qwen3-0.6B's down_proj (gate|up 2 x 3072 -> 1024): equal to
    SwiGLU's Triton kernel then the GEMV (the same activation rounding) and to the torch
    reference, within the tolerance."""
    from chassis.core.layers.triton_gemv import gemv, silu_and_mul_gemv_ref
    from chassis.core.layers.triton_ops import silu_and_mul

    gate_up, _, _ = _tensors(rows, 6144, 1, torch.bfloat16, seed=rows)
    _, weight, bias = _tensors(rows, 3072, 1024, torch.bfloat16, seed=rows + 1)
    fused = gemv(gate_up, weight, bias, silu_and_mul=True)
    _close(fused, gemv(silu_and_mul(gate_up), weight, bias))
    _close(fused, silu_and_mul_gemv_ref(gate_up, weight, bias))


@pytest.mark.parametrize("rows", [1, 8])
def test_post_attention_norm_at_the_gate_up_projection(rows: int) -> None:
    """``add_rms_norm_gemv`` at Qwen3-0.6B's gate/up (1024 -> 6144) after its post-attention
    norm: against RMSNorm's Triton kernel then the GEMV, and the torch reference; the
    residual stream bit-equal to the norm kernel's."""
    from chassis.core.layers.triton_gemv import add_rms_norm_gemv, add_rms_norm_gemv_ref, gemv
    from chassis.core.layers.triton_ops import rms_norm

    x, weight, _ = _tensors(rows, 1024, 6144, torch.bfloat16, seed=rows)
    residual, norm_weight, _ = _tensors(rows, 1024, 1024, torch.bfloat16, seed=rows + 1)
    norm_weight = norm_weight[0].contiguous() + 1
    out, stream = add_rms_norm_gemv(x, residual, norm_weight, 1e-6, weight)
    normed, kernel_stream = rms_norm(x, norm_weight, 1e-6, residual.clone())
    assert torch.equal(stream, kernel_stream)
    _close(out, gemv(normed, weight))
    _close(out, add_rms_norm_gemv_ref(x, residual, norm_weight, 1e-6, weight)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype: torch.dtype) -> None:
    from chassis.core.layers.triton_gemv import gemv, gemv_ref

    for rows in (1, 8):
        x, weight, bias = _tensors(rows, 3072, 1024, dtype)
        _close(gemv(x, weight, bias), gemv_ref(x, weight, bias))


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "reduce"])
@pytest.mark.parametrize("split_k", [1, 4, 16])
def test_every_launch_path(use_dot: bool, split_k: int) -> None:
    from chassis.core.layers.triton_gemv import GemvConfig, gemv, gemv_ref

    config = GemvConfig(block_n=32, block_k=128, split_k=split_k, use_dot=use_dot)
    for rows in (1, 5, 8):
        # 3000 inputs: a partial last tile; 1000 outputs: a partial last block
        x, weight, bias = _tensors(rows, 3000, 1000, torch.bfloat16, seed=rows)
        _close(gemv(x, weight, bias, config=config), gemv_ref(x, weight, bias))


def test_split_launches_back_to_back_agree_bit_for_bit() -> None:
    """200 split launches queued without a sync: each sums its partials in split order, so
    every result is the same bits; a ticket left over by one launch would break a later one."""
    from chassis.core.layers import triton_gemv, triton_ops

    x, weight, bias = _tensors(4, 3072, 1024, torch.bfloat16)
    config = triton_gemv.GemvConfig(split_k=8)
    outputs = [triton_gemv.gemv(x, weight, bias, config=config) for _ in range(200)]
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    _close(outputs[0], triton_gemv.gemv_ref(x, weight, bias))
    torch.cuda.synchronize()
    assert all(not counters.any() for counters in triton_ops._SPLIT_COUNTERS.values())


def test_swapped_layers_replay_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-0.6B MLP and attention projections swapped by the platform
    (``CHASSIS_TRITON_GEMV=1``), captured once per row count as the engine captures decode
    steps (warm-up and capture on a side stream), replayed with new inputs."""
    from chassis.platforms.cuda import CudaPlatform
    from chassis.platforms.cuda_small_batch_linear import SmallBatchLinear, small_batch_layers

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 4096, bias=False),  # q/k/v
        nn.Linear(4096, 2048, bias=False),  # (a stand-in for attention)
        nn.Linear(2048, 1024, bias=False),  # o_proj
        nn.Linear(1024, 6144, bias=False),  # gate/up
        nn.Linear(6144, 3072, bias=False),  # (a stand-in for SiLU-and-mul)
        nn.Linear(3072, 1024, bias=True),  # down (with a bias, for the epilogue)
    ).to("cuda", torch.bfloat16)
    for layer in model:
        nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
    monkeypatch.setenv("CHASSIS_TRITON_GEMV", "1")
    platform = CudaPlatform()
    platform.prepare_model(model)
    assert len(small_batch_layers(model)) == 6
    assert all(type(layer) is SmallBatchLinear for layer in model)

    def reference(x: torch.Tensor) -> torch.Tensor:
        for layer in model:
            bias = None if layer.bias is None else layer.bias.float()
            x = F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)
        return x

    pool = platform.new_graph_pool()
    with torch.inference_mode():
        for rows in (1, 2, 4, 8):
            static_x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            graph, static_out = platform.capture_graph(lambda x=static_x: model(x), pool)
            for seed in range(5):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                static_x.copy_(torch.randn(rows, 1024, device="cuda", generator=gen))
                graph.replay()
                # six layers, each rounded to bfloat16: a few more roundings' slack
                torch.testing.assert_close(static_out, reference(static_x), atol=0.05, rtol=0.05)
                assert torch.equal(static_out, model(static_x))  # eager: the same kernels
        # more rows than the GEMV takes: cuBLAS, as before
        x = torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(model(x), reference(x), atol=0.05, rtol=0.05)
