"""cuBLAS (``F.linear``) against the Triton GEMV at Qwen3-0.6B's linear layers; prints a table.

Not a test: run by tests/gpu/run_gpu_checks.sh (group ``gemv``, step ``bench_gemv``). Per layer
shape and row count (1, 2, 4, 8): microseconds per call (median of ``triton.testing.do_bench``,
which flushes the L2 cache before each call, as a model whose weights far exceed L2 sees them)
and GB/s of weight + input + output bytes, for cuBLAS and for the GEMV's default launch config
(``choose_config``), their ratio, and the GEMV's largest difference from ``gemv_ref``. With
``--sweep`` (what the script runs), a time-boxed sweep of launch configs at 1 and 8 rows
follows: the fastest three per shape next to the default. Between them, the down projection
with SwiGLU's activation folded in (``silu_and_mul=True``) against the activation's kernel
followed by cuBLAS or the GEMV, and gate/up with the post-attention norm folded in
(``add_rms_norm_gemv``) against the norm's kernel followed by either. Without a GPU it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

#: (name, in, out): Qwen3-0.6B, bf16
SHAPES = [
    ("qkv", 1024, 4096),
    ("o_proj", 2048, 1024),
    ("gate_up", 1024, 6144),
    ("down", 3072, 1024),
    ("lm_head", 1024, 151936),
]
ROWS = (1, 2, 4, 8)
DTYPE = torch.bfloat16


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _bytes(rows: int, k: int, n: int) -> int:
    return (n * k + rows * k + rows * n) * torch.finfo(DTYPE).bits // 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument(
        "--sweep-seconds", type=float, default=25.0, help="stop sweeping after this long"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_triton_gemv: no CUDA/ROCm GPU here, nothing to measure (skipped)")
        return 0
    from chassis.core.layers.triton_gemv import GemvConfig, choose_config, gemv, gemv_ref

    print(f"{torch.cuda.get_device_name()}, {DTYPE}, us per call (median, L2 flushed)")
    print(
        f"{'layer':8} {'K->N':>13} {'M':>2} {'cuBLAS us':>10} {'GB/s':>6} {'gemv us':>8} "
        f"{'GB/s':>6} {'speedup':>7} {'max err':>8}  config"
    )
    weights = {}
    for name, k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        weight = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(DTYPE)
        weights[name] = weight
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", generator=g).to(DTYPE)
            config = choose_config(rows, n, k, DTYPE)
            error = (gemv(x, weight).float() - gemv_ref(x, weight).float()).abs().max().item()
            t_cublas = _time_us(lambda x=x, w=weight: F.linear(x, w))
            t_gemv = _time_us(lambda x=x, w=weight: gemv(x, w))
            size = _bytes(rows, k, n)
            print(
                f"{name:8} {f'{k}->{n}':>13} {rows:>2} {t_cublas:10.2f} {size / t_cublas / 1e3:6.0f} "
                f"{t_gemv:8.2f} {size / t_gemv / 1e3:6.0f} {t_cublas / t_gemv:7.2f} {error:8.4f}  "
                f"n{config.block_n} k{config.block_k} split{config.split_k} "
                f"{'dot' if config.use_dot else 'reduce'} w{config.num_warps} s{config.num_stages}",
                flush=True,
            )
    # SwiGLU folded into the down projection: one launch against the activation's kernel
    # followed by the GEMV (and by cuBLAS, what the engine runs without CHASSIS_TRITON_GEMV)
    from chassis.core.layers.triton_ops import silu_and_mul

    print("\ndown_proj with SwiGLU's activation, us per call (median, L2 flushed)")
    weight = weights["down"]
    for rows in ROWS:
        gate_up = torch.randn(rows, 2 * weight.shape[1], device="cuda").to(DTYPE)
        t_two = _time_us(lambda h=gate_up, w=weight: F.linear(silu_and_mul(h), w))
        t_split = _time_us(lambda h=gate_up, w=weight: gemv(silu_and_mul(h), w))
        t_fused = _time_us(lambda h=gate_up, w=weight: gemv(h, w, silu_and_mul=True))
        print(
            f"  M={rows}: silu kernel + cuBLAS {t_two:.2f}, silu kernel + gemv {t_split:.2f}, "
            f"fused gemv {t_fused:.2f}",
            flush=True,
        )
    # the post-attention RMSNorm (with its residual add) folded into gate/up's launch
    from chassis.core.layers.triton_gemv import add_rms_norm_gemv
    from chassis.core.layers.triton_ops import rms_norm

    print("\ngate_up with the post-attention norm, us per call (median, L2 flushed)")
    weight = weights["gate_up"]
    norm_weight = torch.ones(weight.shape[1], device="cuda", dtype=DTYPE)
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], device="cuda").to(DTYPE)
        res = torch.randn_like(x)
        t_two = _time_us(
            lambda x=x, r=res, w=weight: F.linear(rms_norm(x, norm_weight, 1e-6, r)[0], w)
        )
        t_split = _time_us(
            lambda x=x, r=res, w=weight: gemv(rms_norm(x, norm_weight, 1e-6, r)[0], w)
        )
        t_fused = _time_us(
            lambda x=x, r=res, w=weight: add_rms_norm_gemv(x, r, norm_weight, 1e-6, w)
        )
        print(
            f"  M={rows}: norm kernel + cuBLAS {t_two:.2f}, norm kernel + gemv {t_split:.2f}, "
            f"fused gemv {t_fused:.2f}",
            flush=True,
        )
    if not args.sweep:
        return 0
    print(f"\nsweep (at most {args.sweep_seconds:.0f} s): fastest three per layer and M")
    deadline = time.monotonic() + args.sweep_seconds
    # 18 configs; compiled variants depend on the tiles, not on the shape, so the shapes after
    # the first mostly reuse them
    grid = list(itertools.product((True, False), (16, 32, 64), (1, 4, 16)))
    for rows, (name, k, _) in itertools.product((1, 8), SHAPES[:4]):
        weight = weights[name]
        x = torch.randn(rows, k, device="cuda").to(DTYPE)
        results = []
        for use_dot, block_n, split_k in grid:
            if time.monotonic() > deadline:
                break
            try:
                config = GemvConfig(block_n=block_n, block_k=128, split_k=split_k, use_dot=use_dot)
                timed = _time_us(lambda c=config, x=x, w=weight: gemv(x, w, config=c))
                results.append((timed, config))
            except Exception as failed:  # a config that does not compile or launch: skip it
                print(f"  {name} M={rows} {config}: {failed!r:.120}")
        if not results:
            print("  sweep stopped: time is up")
            break
        default = _time_us(lambda x=x, w=weight: gemv(x, w))
        best = ", ".join(
            f"{t:.2f} us (n{c.block_n} split{c.split_k} {'dot' if c.use_dot else 'reduce'})"
            for t, c in sorted(results, key=lambda r: r[0])[:3]
        )
        print(f"  {name:8} M={rows}: default {default:.2f} us; {len(results)} tried: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
