"""The Triton W4A16 GEMM (core/layers/triton_int4.py) against ``int4_linear_ref``.

The kernel runs in the shared ``TRITON_INTERPRET=1`` child (see
tests/test_triton_attention.py for why) at tiny shapes, and is compiled for the GPU
targets without a GPU. tests/gpu/test_gpu_triton_int4.py checks it at real layer shapes.
"""

from __future__ import annotations

import pytest
import torch
from triton_compile_check import (
    TARGETS,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    run_kernel_tests,
)

from chassis.core.layers.int4_linear import int4_linear_ref, pack_codes


def packed_layer(
    in_features: int,
    out_features: int,
    group_size: int,
    act_order: bool,
    dtype: torch.dtype,
    seed: int = 0,
    bits: int = 4,
) -> tuple[torch.Tensor, ...]:
    """``(qweight, scales, zeros, g_idx, bias)`` of a random layer in the packed layout of
    ``bits``-bit codes; act-order: each group's rows scattered over the input (a random
    permutation)."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    codes = torch.randint(0, 1 << bits, (in_features, out_features), generator=g)
    g_idx = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=g)]
    # weights of the same size whatever the width (outputs O(1)-O(10), as the tolerance wants)
    step = 16 / (1 << bits)
    scales = ((torch.rand(groups, out_features, generator=g) * 0.02 + 0.005) * step).to(
        torch.float16
    )
    # up to 2**bits: GPTQ v1's stored zero point plus one
    zeros = torch.randint(0, (1 << bits) + 1, (groups, out_features), generator=g)
    zeros = zeros.to(torch.uint8 if bits == 4 else torch.int16)
    bias = torch.randn(out_features, generator=g).to(dtype)
    return pack_codes(codes, bits), scales, zeros, g_idx.to(torch.int32), bias


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the output dtype's rounding (float32 sums in another order); Triton's
    interpreter converts float32 to bfloat16 by truncation, one more step. Outputs here are
    O(1)-O(10): an absolute tolerance of about two of the dtype's steps at 4."""
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 6.3e-2}[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=1e-2)


@interpreter_parent
def test_int4_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_kernel_tests(__file__, request)


# group sizes: smaller than the 64-row tile, not dividing it, one group; 96 input rows end
# in a partial tile, 40 output columns in a partial one
CASES = [
    (96, 40, 32, False),
    (96, 40, 48, False),
    (96, 40, -1, False),
    (96, 40, 16, True),
    (128, 64, 64, True),
]


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(
    case: tuple[int, int, int, bool], rows: int, dtype: torch.dtype
) -> None:
    from chassis.core.layers.triton_int4 import int4_linear

    in_features, out_features, group_size, act_order = case
    qweight, scales, zeros, g_idx, bias = packed_layer(
        in_features, out_features, group_size, act_order, dtype
    )
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    for b in (None, bias):
        expected = int4_linear_ref(x, qweight, scales, zeros, g_idx, b)
        assert_matches_reference(int4_linear(x, qweight, scales, zeros, g_idx, b), expected)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_8bit_kernel_matches_reference(
    case: tuple[int, int, int, bool], rows: int, dtype: torch.dtype
) -> None:
    """8-bit codes (GPTQ 8-bit, 4 per int32): the same kernel with ``BITS=8``."""
    from chassis.core.layers.triton_int4 import int4_linear

    in_features, out_features, group_size, act_order = case
    qweight, scales, zeros, g_idx, bias = packed_layer(
        in_features, out_features, group_size, act_order, dtype, bits=8
    )
    assert qweight.shape == (in_features // 4, out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = int4_linear_ref(x, qweight, scales, zeros, g_idx, bias)
    assert_matches_reference(int4_linear(x, qweight, scales, zeros, g_idx, bias), expected)


@in_interpreter
def test_kernel_takes_leading_dimensions_and_no_rows() -> None:
    from chassis.core.layers.triton_int4 import int4_linear

    qweight, scales, zeros, g_idx, _ = packed_layer(64, 16, 32, False, torch.float32)
    x = torch.randn(2, 3, 64)
    expected = int4_linear_ref(x, qweight, scales, zeros, g_idx, None)
    assert_matches_reference(int4_linear(x, qweight, scales, zeros, g_idx, None), expected)
    empty = int4_linear(x[:0], qweight, scales, zeros, g_idx, None)
    assert empty.shape == (0, 3, 16)
    with pytest.raises(ValueError, match="features"):
        int4_linear(torch.randn(2, 32), qweight, scales, zeros, g_idx, None)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: str(t[0]))
def test_kernel_compiles_for_gpu_targets(target: tuple) -> None:
    pytest.importorskip("triton")
    from chassis.core.layers import triton_int4

    ints = {"qweight_ptr": "*i32", "g_idx_ptr": "*i32", "scales_ptr": "*fp16"}
    # 4-bit codes at every activation dtype and tile height; 8-bit ones (int16 zero points)
    variants = [
        (4, dtype, block_m) for dtype in ("*bf16", "*fp16", "*fp32") for block_m in (16, 64)
    ]
    variants += [(8, "*bf16", 16), (8, "*fp16", 64)]
    for bits, dtype, block_m in variants:
        tiles = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)
        compile_kernel(
            triton_int4._int4_linear_kernel,
            target,
            dict(HAS_BIAS=True, FLOAT32_DOT=dtype == "*fp32", BITS=bits, **tiles),
            pointer_types={
                **ints,
                "zeros_ptr": "*u8" if bits == 4 else "*i16",
                "x_ptr": dtype,
                "bias_ptr": dtype,
                "out_ptr": dtype,
            },
        )


@pytest.mark.parametrize("tensor", ["qweight", "scales", "zeros"])
def test_kernel_refuses_weight_columns_that_are_not_adjacent(tensor: str) -> None:
    """A column view of a wider tensor would make the kernel read other columns: refused."""
    from chassis.core.layers.triton_int4 import int4_linear

    qweight, scales, zeros, g_idx, bias = packed_layer(64, 32, 16, False, torch.float32)
    parts = {"qweight": qweight, "scales": scales, "zeros": zeros}
    wide = torch.cat([parts[tensor], parts[tensor]], dim=1)
    parts[tensor] = wide[:, ::2]
    assert parts[tensor].stride(-1) == 2
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=f"{tensor} must be 2-D with adjacent columns"):
        int4_linear(x, parts["qweight"], parts["scales"], parts["zeros"], g_idx, bias)
