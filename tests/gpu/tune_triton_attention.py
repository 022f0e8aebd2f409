"""A sweep of ``triton_paged`` decode launch configs at Qwen3-0.6B shapes; prints the best.

Not a test: the ``tune`` step of tests/gpu/run_gpu_checks.sh. For each decode case it times
every config of a small grid (KV tile, warps, pipeline stages, KV splits) with
``triton.testing.do_bench`` and prints the fastest five next to what
``choose_launch_config`` picks today, as KV bytes read per second. Configs that fail to
compile or launch are reported and skipped. The results say which defaults to change.
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import torch
from bench_triton_attention import BLOCK, DIM, HEADS, KV_HEADS, step
from triton.testing import do_bench

from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

CASES = [(1, 1024), (64, 1024), (256, 1024)]
# Each distinct config is a Triton compile (~1 s): the grid stays within the step's limit.
TILE_N = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)


def _launch(args: tuple, config: kernels.LaunchConfig | None) -> None:
    q, _, _, cache, meta = args
    out = torch.empty_like(q)
    kernels.paged_attention(
        q,
        cache,
        out,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_table=meta.block_table,
        num_reqs=meta.num_reqs,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        scale=DIM**-0.5,
        config=config,
    )


def main() -> None:
    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}  bf16, {HEADS}/{KV_HEADS} heads, dim {DIM}, block {BLOCK}"
    )
    start = time.perf_counter()
    for batch, ctx in CASES:
        args, kv_bytes = step([ctx] * batch, 1)
        q, meta = args[0], args[4]
        default = kernels.choose_launch_config(
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            num_tokens=q.shape[0],
            num_reqs=meta.num_reqs,
            max_query_len=1,
            max_seq_len=ctx,
            device=q.device,
        )
        splits = sorted({default.num_splits, 4} if batch < 64 else {default.num_splits})
        results = []
        grid = itertools.product(TILE_N, NUM_WARPS, NUM_STAGES, splits)
        for tile_n, warps, stages, num_splits in grid:
            config = kernels.LaunchConfig(
                default.block_m,
                default.block_q,
                tile_n,
                num_splits,
                warps,
                stages,
                heads_per_program=default.heads_per_program,
            )
            try:
                us = do_bench(partial(_launch, args, config)) * 1e3
            except Exception as exc:  # a config the compiler or the GPU rejects
                print(f"  skipped {config}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append((us, config))
        default_us = do_bench(partial(_launch, args, None)) * 1e3
        results.sort(key=lambda r: r[0])
        print(
            f"decode B={batch} ctx={ctx}: default {default_us:.1f} us "
            f"({kv_bytes / default_us / 1e3:.0f} GB/s) = tile_n {default.tile_n}, warps "
            f"{default.num_warps}, stages {default.num_stages}, splits {default.num_splits}"
        )
        for us, c in results[:5]:
            print(
                f"  {us:8.1f} us {kv_bytes / us / 1e3:6.0f} GB/s  tile_n {c.tile_n:<3} warps "
                f"{c.num_warps} stages {c.num_stages} splits {c.num_splits}"
            )
        print(f"  ({len(results)} configs, {time.perf_counter() - start:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()
