"""The Triton W4A16 GEMM (core/layers/triton_int4.py) on a real GPU, at an 8B Llama layer's
shapes (hidden 4096, merged Q/K/V 6144 outputs, gate/up 2 x 14336, down 14336 -> 4096),
group size 128, with and without act-order, in bfloat16, float16 and float32 (IEEE
products, not TF32), against the torch reference (the weight dequantized, then cuBLAS); run
by tests/gpu/run_gpu_checks.sh (the pytest step). Also: ``--int4-weights auto`` packs on
CUDA, :class:`Int4Linear` picks the kernel there, and a call captured in a CUDA graph
replays with new inputs.
"""

from __future__ import annotations

import pytest
import torch

from chassis.core.int4_packing import keeps_int4_packed
from chassis.core.layers.int4_linear import Int4Linear, int4_linear_ref, pack_codes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
GROUP = 128
SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096)]  # (in, out)
#: about two roundings of the output dtype at O(1) outputs (float32 sums in another order)
TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-4}


def _layer(in_features: int, out_features: int, act_order: bool) -> tuple[torch.Tensor, ...]:
    """A random packed layer on the GPU whose outputs are O(1) for N(0, 1) inputs."""
    g = torch.Generator(device="cuda").manual_seed(in_features + out_features)
    groups = in_features // GROUP
    codes = torch.randint(0, 16, (in_features, out_features), device="cuda", generator=g)
    g_idx = torch.arange(in_features, device="cuda") // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, device="cuda", generator=g)]
    scale = 0.5 / in_features**0.5
    scales = (torch.rand(groups, out_features, device="cuda", generator=g) + 0.5) * scale
    zeros = torch.randint(0, 17, (groups, out_features), device="cuda", generator=g)
    return pack_codes(codes), scales.half(), zeros.to(torch.uint8), g_idx.to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_reference(
    shape: tuple[int, int], dtype: torch.dtype, act_order: bool
) -> None:
    from chassis.core.layers.triton_int4 import int4_linear

    qweight, scales, zeros, g_idx = _layer(*shape, act_order)
    g = torch.Generator(device="cuda").manual_seed(1)
    bias = torch.randn(shape[1], device="cuda", generator=g).to(dtype)
    for rows in (1, 7, 64, 512, 2048):
        x = torch.randn(rows, shape[0], device="cuda", generator=g).to(dtype)
        for b in (None, bias):
            expected = int4_linear_ref(x, qweight, scales, zeros, g_idx, b)
            actual = int4_linear(x, qweight, scales, zeros, g_idx, b)
            assert torch.isfinite(actual).all()
            torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_layer_uses_the_kernel_and_replays_in_a_cuda_graph() -> None:
    from chassis.core.layers import triton_int4

    assert keeps_int4_packed("auto"), "the CUDA platform's layer kernels lack int4_linear"
    qweight, scales, zeros, g_idx = _layer(4096, 6144, act_order=True)
    layer = Int4Linear(qweight, scales, zeros, g_idx, None)
    calls = []
    original = triton_int4.int4_linear

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    triton_int4.int4_linear = counting
    try:
        x = torch.randn(16, 4096, device="cuda").bfloat16()
        with torch.inference_mode():
            out = layer(x)
    finally:
        triton_int4.int4_linear = original
    assert calls, "Int4Linear did not run the Triton kernel on CUDA"
    expected = int4_linear_ref(x, qweight, scales, zeros, g_idx, None)
    torch.testing.assert_close(out, expected, atol=2**-6, rtol=2**-6)

    static_x = torch.zeros(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(static_x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        for seed in (2, 3):
            new_x = torch.randn(
                16, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)
            ).bfloat16()
            static_x.copy_(new_x)
            graph.replay()
            expected = int4_linear_ref(new_x, qweight, scales, zeros, g_idx, None)
            torch.testing.assert_close(static_out, expected, atol=2**-6, rtol=2**-6)
