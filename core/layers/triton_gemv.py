"""A Triton GEMV for the few-row linear layers of decode: ``y = x @ W.T (+ bias)``, ``x`` of 1-8
rows.

Why: at batch 1 a decode step's matmuls are matrix-vector products that only have to read the
weight once; on an H200 (Qwen3-0.6B, bf16, in CUDA graphs) cuBLAS read gate/up's 12.6 MB at
about 1 TB/s of the GPU's ~4.3, and split down_proj into a GEMM plus a separate split-K reduce
kernel (docs/gpu.md, "Small-batch GEMV"). Opt-in (``CHASSIS_TRITON_GEMV=1``) until measured.

Design, for bandwidth:

- program ``(n, s)`` owns ``BLOCK_N`` output features and the ``s``-th of ``SPLIT_K`` ranges of
  the input dimension; it streams its ``BLOCK_N`` rows of ``W`` (row-major ``[N, K]``, as
  ``nn.Linear`` holds it, so every row segment is a contiguous, vectorizable load) in
  ``BLOCK_K`` tiles, and applies each tile to all ``M <= 8`` rows of ``x``: ``W`` is read once;
- two inner products, a ``constexpr`` switch: ``USE_DOT`` pads ``x`` to a 16-row tile and
  uses ``tl.dot`` (tensor cores; the padding costs no memory traffic), otherwise products are
  summed per lane on the CUDA cores and reduced over K once, after the loop. The heuristic
  takes the dot: compiled for sm_90, its weight tiles stream through shared memory with
  ``cp.async`` in a ``num_stages`` pipeline (several tiles in flight per program), while the
  other path's loads are plain 16-byte loads, one tile at a time.
  ``tests/gpu/bench_triton_gemv.py --sweep`` compares them;
- split-K, where the output alone gives too few programs to keep every multiprocessor reading
  (``N = 1024``: 32 programs of 32 features): each program writes its float32 partial sums to
  a workspace, then takes a ticket from a per-output-block counter (one integer atomic); the
  program that arrives last adds the ``SPLIT_K`` partials *in split order*, adds the bias,
  rounds once, stores, and resets the counter to 0 for the next launch. Chosen over (a) a
  second reduce kernel: one more launch per layer, what cuBLAS's split-K pays (1.6 us per
  down_proj call on the H200, 45 us a step over 28 layers), and over (b) float32 atomic adds
  into the output: those need a zeroed float32 buffer (a memset launch) and a cast launch, and
  their sum order, so the result, changes from run to run. The ticket costs one atomic per
  program and a workspace of ``SPLIT_K * M * N`` floats.

The counters are a small int32 buffer per (device, stream), zero between launches
(``triton_ops.split_counters``, shared with ``triton_paged``'s split-KV merge): launches of
one stream run one after another, so they never share a counter; two streams get two buffers.

Float32 accumulation, the bias added in float32, the output rounded once to ``x``'s dtype
(:func:`gemv_ref`; cuBLASLt's bias epilogue also adds before rounding). No host sync:
launch configs come from shapes. On the CPU the kernel runs only under Triton's interpreter
(``TRITON_INTERPRET=1``), where products are taken in float32 (the interpreter computes
bfloat16 arithmetic on raw bits). Float32 inputs multiply in IEEE float32, not TF32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chassis.core.layers.triton_ops import (
    NUM_SPLIT_COUNTERS,
    check_launchable,
    is_interpreted,
    split_counters,
)

__all__ = [
    "MAX_ROWS",
    "GemvConfig",
    "add_rms_norm_gemv",
    "add_rms_norm_gemv_ref",
    "choose_config",
    "gemv",
    "gemv_ref",
    "silu_and_mul_gemv_ref",
]

#: the most rows (tokens) the kernel takes: beyond that a GEMM kernel reuses each weight tile
#: for enough rows that cuBLAS's GEMMs are the right tool
MAX_ROWS = 8
#: programs the heuristic aims for: about two per multiprocessor of an H200 (132 SMs), so that
#: every SM has loads in flight
TARGET_PROGRAMS = 256
#: output blocks a split launch may have: it takes one counter per output block from its
#: stream's shared buffer (``triton_ops.split_counters``)
MAX_SPLIT_BLOCKS = NUM_SPLIT_COUNTERS
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration (:func:`choose_config` picks one; ``gemv(config=...)`` takes
    any, for tuning sweeps).

    :param block_n: output features per program (a power of two; at least 16 with ``use_dot``)
    :param block_k: input features per tile (a power of two, at least 16)
    :param split_k: programs that share one output block, each over its own input range (1:
        no split); their partial sums meet in the last one to finish
    :param use_dot: ``tl.dot`` on a 16-row padded tile, else a multiply-and-reduce per row
    """

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    use_dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.block_k < 16 or (self.use_dot and self.block_n < 16):
            raise ValueError(
                "GemvConfig: block_k must be at least 16, and block_n too with use_dot "
                f"(tl.dot's smallest tile), got block_n={self.block_n} block_k={self.block_k}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(
                f"GemvConfig: num_warps must be 1-16 (a power of two) and num_stages >= 1, got "
                f"{self.num_warps} and {self.num_stages}"
            )


def choose_config(rows: int, out_features: int, in_features: int, dtype: torch.dtype) -> GemvConfig:
    """The default launch configuration for ``rows`` x ``[out_features, in_features]`` (one
    for every row count so far: ``rows`` is there for a tuned table to use).

    Unmeasured so far (docs/gpu.md); the rules:

    - ``block_k`` 128 (64 for float32): 256-byte row segments, 16-byte loads per thread;
    - ``block_n`` 64 when that still gives :data:`TARGET_PROGRAMS` output blocks (an LM head),
      else 32;
    - ``split_k`` doubles while the programs are under :data:`TARGET_PROGRAMS` and each split
      keeps at least two ``block_k`` tiles (Qwen3-0.6B: q/k/v 1024 -> 4096 splits in 2, o_proj
      2048 -> 1024 in 8, gate/up 1024 -> 6144 in 2, down 3072 -> 1024 in 8, the LM head not);
    - ``use_dot`` (its loads are pipelined; see the module docstring).
    """
    block_k = 64 if dtype == torch.float32 else 128
    block_k = max(16, min(block_k, triton.next_power_of_2(in_features)))
    block_n = 64 if triton.cdiv(out_features, 64) >= TARGET_PROGRAMS else 32
    blocks = triton.cdiv(out_features, block_n)
    tiles = triton.cdiv(in_features, block_k)
    split_k = 1
    while blocks * split_k < TARGET_PROGRAMS and tiles >= 4 * split_k and split_k < 16:
        split_k *= 2
    if blocks > MAX_SPLIT_BLOCKS:
        split_k = 1
    return GemvConfig(
        block_n=block_n,
        block_k=block_k,
        num_warps=4,
        num_stages=3 if dtype == torch.float32 else 4,
        split_k=split_k,
        use_dot=True,
    )


@triton.jit(do_not_specialize=["M", "tiles_per_split", "eps"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    tiles_per_split,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    stride_rm,
    stride_rom,
    eps,
    HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    ADD_RMS_NORM: tl.constexpr,
    K_POW2: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # int64 row offsets: an LM head's rows x in_features may pass 2**31 elements
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    tile_start = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, tl.cdiv(K, BLOCK_K))
    dtype = out_ptr.dtype.element_ty
    # rows past M (padding to BLOCK_M) read row M - 1 again: no row mask on the loads, and
    # their sums land in accumulator rows that are never stored
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    if ADD_RMS_NORM:
        # The input is RMSNorm(x + residual) * norm_w, as RMSNorm's kernel computes it: every
        # program takes each row's statistics over the whole row first (x and the residual
        # are a few KiB, from L2), then normalizes its own tiles as they load. Program (0, 0)
        # writes the residual stream x + residual (to a new tensor: the inputs stay as they
        # are while other programs read them).
        res_rows = res_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_rm
        cols = tl.arange(0, K_POW2)
        mask_cols = cols < K
        denom = tl.full((BLOCK_M,), 1.0, tl.float32)
        for m in range(0, M):
            xr = tl.load(x_ptr + m * stride_xm + cols, mask=mask_cols, other=0.0)
            rr = tl.load(res_ptr + m * stride_rm + cols, mask=mask_cols, other=0.0)
            h = (xr.to(tl.float32) + rr.to(tl.float32)).to(dtype)
            if (pid_n == 0) & (pid_k == 0):
                tl.store(res_out_ptr + m * stride_rom + cols, h, mask=mask_cols)
            h32 = h.to(tl.float32)
            row_denom = tl.sqrt_rn(tl.sum(h32 * h32, 0) / K + eps)
            denom = tl.where(offs_m == m, row_denom, denom)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # products summed per lane; one reduction over K after the loop
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # (over tile numbers: each tile's start is then a known multiple of BLOCK_K, which the
    # compiler needs to vectorize the loads)
    for tile in range(tile_start, tile_end):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:  # whole tiles: no mask along K
            mask_k = tl.full((BLOCK_K,), True, tl.int1)
        else:
            mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if SILU_AND_MUL:
            # x is [M, 2K], gate | up: the input is silu(gate) * up, rounded as
            # SiluAndMul's kernel rounds it (silu to the dtype, then the product)
            gate = tl.load(x_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            up = tl.load(x_rows + K + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            gate32 = gate.to(tl.float32)
            act = (gate32 / (1.0 + tl.exp(-gate32))).to(dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(dtype)
        elif ADD_RMS_NORM:
            xr = tl.load(x_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            rr = tl.load(res_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            h32 = (xr.to(tl.float32) + rr.to(tl.float32)).to(dtype).to(tl.float32)
            normed = (h32 / denom[:, None]).to(dtype).to(tl.float32)
            scale = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (normed * scale[None, :]).to(dtype)
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        if USE_DOT:
            if FLOAT32_DOT:  # IEEE float32 (not TF32); the interpreter's 16-bit dots too
                acc = tl.dot(
                    x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(dtype), mask=mask_mn)
    else:
        # workspace [SPLIT_K, M, N] float32: this split's partial sums
        ws_block = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_block + pid_k * M * N, acc, mask=mask_mn)
        # every thread's stores issued before the ticket; the atomic releases them (gpu scope)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:  # the last of the block's splits: sum them, in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other programs' stores are (L1 is not coherent)
                total += tl.load(
                    ws_block + s * M * N, mask=mask_mn, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(dtype), mask=mask_mn)
            tl.store(counter_ptr + pid_n, 0)  # zero again for the stream's next split launch


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The specification: ``x @ weight.T + bias`` in float32, rounded once to ``x``'s dtype
    (``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or None)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def silu_and_mul_gemv_ref(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The specification of ``gemv(..., silu_and_mul=True)``: ``silu(gate) * up`` rounded as
    ``fused_ops.silu_and_mul_ref`` rounds it (``gate_up [..., 2 * in]``), then
    :func:`gemv_ref`."""
    from chassis.core.layers.fused_ops import silu_and_mul_ref

    return gemv_ref(silu_and_mul_ref(gate_up), weight, bias)


def add_rms_norm_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of :func:`add_rms_norm_gemv`: ``fused_ops.rms_norm_ref`` with the
    residual, then :func:`gemv_ref`; returns ``(output, x + residual)``."""
    from chassis.core.layers.fused_ops import rms_norm_ref

    normed, stream = rms_norm_ref(x, norm_weight, eps, residual)
    return gemv_ref(normed, weight, bias), stream


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` in ``x``'s dtype, as :func:`gemv_ref` computes it (float32
    sums in another order: an output may differ from it by a rounding step of its dtype).

    ``x`` has at most :data:`MAX_ROWS` rows once its leading dimensions are flattened, and
    unit stride along ``K``; ``weight`` is ``[N, K]`` with unit stride along ``K`` (an
    ``nn.Linear``'s weight); ``bias`` a contiguous ``[N]``; all of one dtype (bfloat16,
    float16 or float32) and device. ``config`` overrides :func:`choose_config`. ``ValueError``
    when these do not hold or the kernel cannot run on ``x``'s device (no operand is made
    contiguous here: a copy would hide a launch in every call; leading dimensions that do not
    flatten to a view are the exception, as in ``F.linear``).

    ``silu_and_mul``: ``x`` is ``[..., 2 * K]``, a SwiGLU's gate and up halves, and the
    product's input is ``silu(gate) * up`` (:func:`silu_and_mul_gemv_ref`), computed as each
    tile is loaded: the activation's own kernel launch (and its output's round trip through
    memory) is saved; each program recomputes the activation of its K range."""
    return _gemv(x, weight, bias, config, silu_and_mul=silu_and_mul)


def add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x + residual)`` (``norm_weight``, ``eps``; RMSNorm's kernel's rounding), then
    :func:`gemv`: one launch for a decoder layer's residual add, its norm and the following
    linear layer. Returns ``(output [..., N], x + residual)``, the second a new tensor (the
    residual stream the layer continues from; the inputs are not modified).

    ``x`` and ``residual`` are ``[..., K]`` of one shape, dtype and device, unit stride along
    ``K``; ``norm_weight`` a contiguous ``[K]`` of their dtype. Every program takes the rows'
    statistics over all of ``K`` (a few KiB of reads from L2 per program) before its own
    tiles; the results equal :func:`add_rms_norm_gemv_ref` within a rounding step (float32
    sums in another order). Other conditions and errors as :func:`gemv`.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x: got {tuple(residual.shape)} {residual.dtype} on "
            f"{residual.device} for x {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if (
        norm_weight.shape != (x.shape[-1],)
        or norm_weight.stride(0) != 1
        or norm_weight.dtype != x.dtype
        or norm_weight.device != x.device
    ):
        raise ValueError(
            f"norm_weight must be a contiguous [{x.shape[-1]}] {x.dtype} vector on {x.device}, "
            f"got {tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}"
        )
    stream = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = _gemv(x, weight, bias, config, norm=(residual, norm_weight, float(eps), stream))
    return out, stream


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    *,
    silu_and_mul: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`gemv`'s checks and launch; ``norm`` is ``(residual, norm_weight, eps,
    stream_out)`` for :func:`add_rms_norm_gemv`."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be 2-D [out, in] with unit stride along in, got shape "
            f"{tuple(weight.shape)} stride {weight.stride()}"
        )
    out_features, in_features = weight.shape
    x_features = 2 * in_features if silu_and_mul else in_features
    if x.dim() == 0 or x.shape[-1] != x_features:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; the weight takes {in_features} features"
            + (" (x holds gate and up: twice as many)" if silu_and_mul else "")
        )
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share one of {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}"
        )
    if bias is not None and (
        bias.shape != (out_features,) or bias.stride(0) != 1 or bias.dtype != x.dtype
    ):
        raise ValueError(
            f"bias must be a contiguous [{out_features}] {x.dtype} vector, got shape "
            f"{tuple(bias.shape)} stride {bias.stride()} dtype {bias.dtype}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must be on one device, got x on {x.device}")
    rows = x.reshape(-1, x_features)
    num_rows = rows.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {num_rows}; use F.linear")
    if in_features > 1 and rows.stride(1) != 1:
        raise ValueError(f"x must have unit stride along its last dimension, got {x.stride()}")
    if norm is not None:
        residual, norm_weight, eps, stream = norm
        res_rows = residual.reshape(-1, in_features)
        stream_rows = stream.view(-1, in_features)
        if in_features > 1 and res_rows.stride(1) != 1:
            raise ValueError(
                f"residual must have unit stride along its last dimension, got {residual.stride()}"
            )
    else:
        res_rows = stream_rows = norm_weight = rows  # (unused)
        eps = 0.0
    kernel = check_launchable(_gemv_kernel, x)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if norm is not None and out_features == 0:  # no program runs, yet the stream is needed
        stream_rows.copy_(rows + res_rows)
    if num_rows == 0 or out_features == 0:
        return out.reshape(*x.shape[:-1], out_features)
    if in_features == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand_as(out))).reshape(
            *x.shape[:-1], out_features
        )
    config = config or choose_config(num_rows, out_features, in_features, x.dtype)
    blocks = triton.cdiv(out_features, config.block_n)
    tiles = triton.cdiv(in_features, config.block_k)
    tiles_per_split = triton.cdiv(tiles, min(config.split_k, tiles))
    split_k = triton.cdiv(tiles, tiles_per_split)  # every split has at least one tile
    if split_k > 1:
        if blocks > MAX_SPLIT_BLOCKS:
            raise ValueError(
                f"a split launch takes at most {MAX_SPLIT_BLOCKS} output blocks, got {blocks} "
                f"({out_features} features in blocks of {config.block_n})"
            )
        workspace = torch.empty(
            split_k, num_rows, out_features, dtype=torch.float32, device=x.device
        )
        counters = split_counters(x.device)
    else:
        workspace = counters = out  # (unused)
    interpreted = is_interpreted(kernel)
    kernel[(blocks, split_k)](
        rows,
        weight,
        bias if bias is not None else weight,
        out,
        workspace,
        counters,
        num_rows,
        out_features,
        in_features,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        tiles_per_split,
        res_rows,
        norm_weight,
        stream_rows,
        res_rows.stride(0),
        stream_rows.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=silu_and_mul,
        ADD_RMS_NORM=norm is not None,
        K_POW2=triton.next_power_of_2(in_features) if norm is not None else 16,
        SPLIT_K=split_k,
        USE_DOT=config.use_dot,
        FLOAT32_DOT=x.dtype == torch.float32 or interpreted,
        EVEN_K=in_features % config.block_k == 0,
        BLOCK_M=16 if config.use_dot else triton.next_power_of_2(num_rows),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.reshape(*x.shape[:-1], out_features)
