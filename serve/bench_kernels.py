"""``chassis bench kernels``: the CPU linear and attention kernels against their alternatives.

Times, on random data shaped like a model's layers:

- **linear**: for each row count, ``--layers`` layers' worth of the MLP weights (gate/up
  ``[2 * intermediate, hidden]`` and down ``[hidden, intermediate]``), distinct per layer so
  the weights come from memory as in a decode step, through ``chassis_cpu::linear``,
  oneDNN's packed linear and plain ``F.linear``; prints ms per pass and GFLOP/s;
- **attention**: single-row attention for ``B`` requests of ``--context`` positions over
  ``--layers`` distinct paged bf16 caches (blocks in shuffled order), one call per layer so
  each layer's K/V comes from memory as in a decode step, through
  ``chassis_cpu::decode_attention`` and the SDPA fallback of ``cpu_paged``
  (``CHASSIS_CPU_KERNELS=0``); prints microseconds per layer.

Shapes default to SmolLM2-135M's (hidden 576, intermediate 1536, 9 heads, 3 kv heads, head
dim 64). Use it to compare kernel changes on a quiet machine; it is not an engine benchmark.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def add_kernel_bench_parser(kinds: Any) -> None:
    p = kinds.add_parser("kernels", help="time the CPU linear and attention kernels")
    # the defaults are SmolLM2-135M's shapes
    p.add_argument("--hidden", type=int, default=576, help="hidden size (default: 576)")
    p.add_argument(
        "--intermediate", type=int, default=1536, help="MLP intermediate size (default: 1536)"
    )
    p.add_argument("--heads", type=int, default=9, help="attention query heads (default: 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="attention KV heads (default: 3)")
    p.add_argument("--head-dim", type=int, default=64, help="attention head size (default: 64)")
    p.add_argument("--layers", type=int, default=30, help="distinct weight sets per pass")
    p.add_argument("--rows", default="1,8,16,32,512,2048", help="linear row counts")
    p.add_argument("--batch", default="1,8,32", help="attention batch sizes")
    p.add_argument("--context", type=int, default=200, help="attention positions per request")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed calls per measurement, averaged (default: 5)"
    )
    p.set_defaults(run=run)


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention, _Rows
    from chassis.platforms import cpu_kernels
    from chassis.platforms.cpu import keep_heap_allocations

    keep_heap_allocations()  # as the engine's worker does
    ops = cpu_kernels.load()
    if ops is None:
        print("the CPU kernels are not available (no compiler, or CHASSIS_CPU_KERNELS=0)")
        return 1
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    h, inter = args.hidden, args.intermediate
    weights = [w for _ in range(args.layers) for w in (randn(2 * inter, h), randn(h, inter))]
    chassis = [ops.pack_linear(w) for w in weights] if ops.bf16_linear_available() else None
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"linear: {args.layers} layers of [{2 * inter}x{h}] and [{h}x{inter}] bf16 weights")
    if chassis is None:
        print("  chassis_cpu::linear: not built for this CPU (it needs AVX512-BF16)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {h: randn(rows, h), inter: randn(rows, inter)}
        variants: dict[str, Callable[[], object]] = {
            "oneDNN packed": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, onednn, strict=True)
            ],
            "F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
        }
        if chassis is not None:
            variants["chassis_cpu::linear"] = lambda xs=xs: [
                ops.linear(xs[w.shape[1]], p, None) for w, p in zip(weights, chassis, strict=True)
            ]
        for name, fn in variants.items():
            seconds = _time(fn, args.repeats)
            gflops = flops_per_row * rows / seconds / 1e9
            print(f"  rows {rows:5d}  {name:20s} {seconds * 1e3:9.2f} ms  {gflops:6.0f} GFLOP/s")

    kv, d, heads, ctx = args.kv_heads, args.head_dim, args.heads, args.context
    block = 16
    blocks_per_req = -(-ctx // block)
    print(
        f"attention: {heads} heads, {kv} kv heads, head dim {d}, {ctx} positions, block 16, "
        f"{args.layers} layers"
    )
    for batch in (int(b) for b in args.batch.split(",")):
        num_blocks = batch * blocks_per_req + 1
        caches = [randn(num_blocks, 2, block, kv, d) for _ in range(args.layers)]
        order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_req]
        table = order.to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        query = randn(batch, heads, d)
        rows = _Rows(tokens=None, count=batch, block_table=table, seq_lens=lens)
        kernel = CpuPagedAttention(heads, d, kv, d**-0.5)
        fallback = CpuPagedAttention(heads, d, kv, d**-0.5)
        fallback.kernels = None
        for name, backend in (("decode_attention", kernel), ("SDPA fallback", fallback)):
            seconds = _time(
                lambda b=backend, q=query, cs=caches, r=rows: [b._rows(q, c, r) for c in cs],
                args.repeats,
            )
            per_layer = seconds / args.layers
            print(f"  batch {batch:4d}  {name:20s} {per_layer * 1e6:9.1f} us per layer")
    return 0
