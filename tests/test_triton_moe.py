"""The Triton fused-MoE path (core/layers/triton_moe.py) against ``fused_experts_ref``.

:func:`moe_align` is plain torch and is tested in-process; the kernels run in a child pytest
with ``TRITON_INTERPRET=1`` (see tests/test_triton_attention.py for why), on tiny shapes so
that the interpreter stays fast; and they are compiled for the GPU targets without a GPU.
tests/gpu/test_gpu_triton_moe.py checks them at a real layer's shape and under CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_ops import bfloat16_rounds_to_nearest  # noqa: F401  (a fixture)
from triton_compile_check import (
    INTERPRETED,
    TARGETS,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
    run_under_interpreter,
)

from chassis.core.layers.moe import FusedMoE, fused_experts_ref, select_experts

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to rounding. The kernels round five times in a row where the reference
    does (gate, up, silu, product, down); Triton's interpreter converts float32 to bfloat16
    by truncation, so there bfloat16 results may be a few ulps off (the GPU rounds to
    nearest: test_bfloat16_rounds_where_the_reference_does and tests/gpu/ check that)."""
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3.2e-2}[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _experts(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed=0
) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, weights, ids)`` with O(1) activations, softmax top-k routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, True)
    return x, w13, w2, weights, ids


@interpreter_parent
def test_moe_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_kernel_tests(__file__, request)


@not_in_interpreter
def test_triton_36_skips_the_interpreter_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter (the H200 image's) cannot loop over a runtime scalar, so the
    parent skips with the reason instead of failing on every kernel (the GPU compiles)."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    with pytest.raises(pytest.skip.Exception, match=r"Triton 3\.6\.0's interpreter .*< 3\.7"):
        run_under_interpreter(__file__)


# -- moe_align (plain torch, in-process) --------------------------------------------------------


def _check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every property the kernels rely on, checked against a direct count."""
    from chassis.core.layers.triton_moe import max_blocks, moe_align

    sorted_ids, block_experts, num_rows = moe_align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    blocks = max_blocks(num_pairs, num_experts, block_m)
    assert sorted_ids.dtype == block_experts.dtype == num_rows.dtype == torch.int32
    assert sorted_ids.shape == (blocks * block_m,) and block_experts.shape == (blocks,)
    # the bound of the brief, T*k + E*(block_m - 1) rows, holds
    assert blocks * block_m <= num_pairs + num_experts * (block_m - 1)

    rows = sorted_ids.tolist()
    real = [r for r in rows if r != num_pairs]
    assert sorted(real) == list(range(num_pairs))  # each pair exactly once, padding = T*k
    row = 0
    for expert in range(num_experts):
        pairs = [p for p in range(num_pairs) if flat[p] == expert]
        if not pairs:
            continue
        assert row % block_m == 0  # groups start at multiples of block_m
        padded = -(-len(pairs) // block_m) * block_m
        assert rows[row : row + len(pairs)] == pairs  # increasing pair order
        assert rows[row + len(pairs) : row + padded] == [num_pairs] * (padded - len(pairs))
        group_blocks = block_experts[row // block_m : (row + padded) // block_m]
        assert group_blocks.tolist() == [expert] * (padded // block_m)
        row += padded
    assert num_rows.tolist() == [row]
    assert rows[row:] == [num_pairs] * (len(rows) - row)
    assert block_experts[row // block_m :].tolist() == [-1] * (blocks - row // block_m)


@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m",
    [
        (1, 8, 2, 16),
        (37, 8, 3, 16),
        (64, 128, 8, 16),
        (40, 4, 4, 16),
        (200, 6, 2, 32),
        (3, 4, 1, 4),
    ],
)
def test_align_groups_pairs_by_expert(tokens: int, experts: int, top_k: int, block_m: int):
    g = torch.Generator().manual_seed(tokens)
    _, ids = torch.topk(torch.rand(tokens, experts, generator=g), top_k)
    _check_alignment(ids, experts, block_m)


def test_align_with_unused_experts_repeats_and_int32_ids() -> None:
    ids = torch.tensor([[5, 5], [0, 5], [5, 2], [7, 0]], dtype=torch.int32)  # 1, 3, 4, 6 unused
    _check_alignment(ids, 8, 2)
    _check_alignment(ids, 8, 16)
    _check_alignment(torch.full((33, 1), 3), 4, 16)  # one expert, several blocks
    _check_alignment(torch.zeros(0, 2, dtype=torch.long), 4, 16)


def test_align_needs_no_values_on_the_host() -> None:
    """On the meta device tensors have shapes and no values: a host read (``.item()``,
    ``nonzero``, ``bincount``) or a value-dependent output size would fail here, as it would
    break CUDA-graph capture."""
    from chassis.core.layers.triton_moe import max_blocks, moe_align

    ids = torch.empty(7, 8, dtype=torch.long, device="meta")
    sorted_ids, block_experts, num_rows = moe_align(ids, 128, 16)
    blocks = max_blocks(56, 128, 16)
    assert sorted_ids.shape == (blocks * 16,) and block_experts.shape == (blocks,)
    assert num_rows.shape == (1,)


def test_align_rejects_bad_arguments() -> None:
    from chassis.core.layers.triton_moe import moe_align

    with pytest.raises(ValueError, match="integer"):
        moe_align(torch.zeros(3, 2), 4, 16)
    with pytest.raises(ValueError, match=r"\[tokens, k\]"):
        moe_align(torch.zeros(6, dtype=torch.long), 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(torch.zeros(3, 2, dtype=torch.long), 4, 0)


def test_fused_moe_rejects_bad_operands() -> None:
    from chassis.core.layers.triton_moe import fused_moe

    x, w13, w2, weights, ids = _experts(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="must be"):
        fused_moe(x[:, :16], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="must share"):
        fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="integer"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="floating"):
        fused_moe(x, w13, w2, ids, ids)
    with pytest.raises(ValueError, match="last dimension"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    if not INTERPRETED:  # compiled kernels take CUDA/ROCm tensors only
        with pytest.raises(ValueError, match="CUDA/ROCm"):
            fused_moe(x, w13, w2, weights, ids)


# -- the kernels (interpreter) ------------------------------------------------------------------

#: (tokens, hidden, inter, experts, top_k): one token; tokens not a multiple of the block;
#: k = 1; k = E; every expert's group over one block (40 * 4 / 4 = 40 rows of 16-row blocks);
#: dims that are not powers of two
SHAPES = [
    (1, 32, 16, 4, 2),
    (37, 64, 48, 8, 3),
    (9, 32, 16, 8, 1),
    (6, 48, 24, 4, 4),
    (40, 40, 20, 4, 4),
]


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from chassis.core.layers.triton_moe import fused_moe

    x, w13, w2, weights, ids = _experts(*shape, dtype=dtype)
    _close(fused_moe(x, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_with_unchosen_experts_and_model_dtype_weights(dtype: torch.dtype) -> None:
    """Experts 1, 3, 4 and 6 are chosen by nobody (their blocks do not exist), one expert
    takes more than one block, and the routing weights are in the model dtype (Qwen's
    rounding)."""
    from chassis.core.layers.triton_moe import fused_moe

    x, w13, w2, weights, _ = _experts(20, 32, 16, 8, 2, dtype=dtype, seed=3)
    ids = torch.tensor([[5, 0], [2, 5], [7, 5], [0, 2]]).repeat(5, 1)
    weights = weights.to(dtype)
    _close(fused_moe(x, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids))


@in_interpreter
def test_kernel_on_strided_tokens_and_no_tokens() -> None:
    from chassis.core.layers.triton_moe import fused_moe

    x, w13, w2, weights, ids = _experts(5, 32, 16, 4, 2, dtype=torch.float32)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :32]  # rows 64 apart
    _close(fused_moe(wide, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids))
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32) and empty.dtype == torch.float32


@in_interpreter
@pytest.mark.usefixtures("bfloat16_rounds_to_nearest")
@pytest.mark.parametrize("shape", [(37, 64, 48, 8, 3), (6, 48, 24, 4, 4)], ids=str)
def test_bfloat16_rounds_where_the_reference_does(shape: tuple[int, ...]) -> None:
    """With the GPU's rounding (to nearest even), bfloat16 results equal the reference bit
    for bit on these inputs: the kernels round the gate and up matmuls, silu, the product and
    the down matmul where the reference does, and sum in float32 (a kernel that skips or adds
    a rounding fails here)."""
    from chassis.core.layers.triton_moe import fused_moe

    x, w13, w2, weights, ids = _experts(*shape, dtype=torch.bfloat16, seed=1)
    got = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(got, fused_experts_ref(x, w13, w2, weights, ids))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_runs_the_platform_kernel(dtype: torch.dtype, monkeypatch) -> None:
    """FusedMoE.forward with TritonLayerKernels as the platform's kernels (what the CUDA
    platform hands it) calls fused_moe once and gives the reference's result."""
    from chassis.core.layers.triton_ops import TritonLayerKernels

    kernels = TritonLayerKernels()
    calls = []
    fused = kernels.fused_moe
    monkeypatch.setattr(kernels, "fused_moe", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr("chassis.core.layers.moe.kernels_for", lambda x: kernels)
    layer = FusedMoE(8, 2, 32, 16, renormalize=True, round_weights_to_model_dtype=True)
    x, w13, w2, _, _ = _experts(11, 32, 16, 8, 2, dtype=dtype, seed=2)
    layer = layer.to(dtype)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
    logits = torch.randn(11, 8, generator=torch.Generator().manual_seed(5))
    weights, ids = select_experts(logits, 2, True)
    with torch.no_grad():
        got = layer(x, logits)
    assert calls == [1]
    _close(got, fused_experts_ref(x, w13, w2, weights.to(dtype), ids))


# -- compiled for the GPUs, without one -----------------------------------------------------------

#: the first kernel's epilogue switches of the plain SiLU-and-mul path (gpt-oss's variant:
#: tests/test_triton_moe_bias.py)
PLAIN = dict(CLAMPED_SWIGLU=False, ALPHA=0.0, LIMIT=0.0)


@not_in_interpreter
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_kernels_compile_for_gpu_targets(target) -> None:
    pytest.importorskip("triton")
    from chassis.core.layers import triton_moe

    ints = {"sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32"}
    # decode (16-row blocks) and prefill (64-row blocks, 8 warps) configurations, bfloat16,
    # with routing weights in bfloat16 (Qwen) and in float32 (Mixtral)
    for block_m, block_n, warps, weights in ((16, 32, 4, "*bf16"), (64, 64, 8, "*fp32")):
        tiles = dict(
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, DOT_FP32=False, HAS_BIAS=False
        )
        compile_kernel(
            triton_moe._gate_up_kernel,
            target,
            dict(TOP_K=8, **PLAIN, **tiles),
            pointer_types=ints,
            num_warps=warps,
        )
        compile_kernel(
            triton_moe._down_kernel,
            target,
            tiles,
            pointer_types={**ints, "out_ptr": "*fp32", "weights_ptr": weights},
            num_warps=warps,
        )
    # float32 models: IEEE float32 dots; routing weights in the model dtype
    fp32 = {n: "*fp32" for n in ("x_ptr", "w13_ptr", "h_ptr", "w2_ptr", "out_ptr")}
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, DOT_FP32=True, HAS_BIAS=False)
    compile_kernel(
        triton_moe._gate_up_kernel,
        target,
        dict(TOP_K=2, **PLAIN, **tiles),
        pointer_types={**ints, **fp32, "b13_ptr": "*fp32"},
    )
    compile_kernel(
        triton_moe._down_kernel,
        target,
        tiles,
        pointer_types={**ints, **fp32, "b2_ptr": "*fp32", "weights_ptr": "*fp32"},
    )
