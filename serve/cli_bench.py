"""``chassis bench throughput|latency|serve``: the standard benchmarks."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    from chassis.serve.args import add_engine_args

    bench = subparsers.add_parser("bench", help="run a benchmark (throughput, latency, serve)")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a random-token workload")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", default="32:256", help="N or MIN:MAX (uniform); default 32:256")
    tp.add_argument("--output-len", default="32:128", help="N or MIN:MAX (uniform); default 32:128")
    _add_common(tp)
    tp.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF generate batch size (default: all prompts in one padded batch)",
    )
    tp.set_defaults(run=_run_offline)

    lat = kinds.add_parser("latency", help="end-to-end latency of one batch (default batch 1)")
    add_engine_args(lat)
    lat.add_argument("--input-len", default="128")
    lat.add_argument("--output-len", default="256")
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    _add_common(lat)
    lat.set_defaults(run=_run_offline)

    try:
        from chassis.serve.bench_serve import add_serve_bench_parser
    except ModuleNotFoundError as exc:
        if exc.name != "chassis.serve.bench_serve":
            raise
    else:
        add_serve_bench_parser(kinds)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("chassis", "hf"),
        default="chassis",
        help="'hf' also runs HF transformers generate on the same workload and prints the ratio",
    )
    parser.add_argument("--output-json", default=None, help="write the results here as JSON")


def _run_offline(args: argparse.Namespace) -> int:
    from chassis.serve import bench_offline
    from chassis.serve.args import engine_config_from_args

    config = engine_config_from_args(args)
    if args.bench_kind == "throughput":
        bench_offline.throughput(args, config)
    else:
        bench_offline.latency(args, config)
    return 0
