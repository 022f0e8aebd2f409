"""``chassis bench throughput|latency|step|kernels|serve``: the standard benchmarks.

``--model-preset NAME`` (offline benchmarks) names a model config shipped in
``serve/bench_models/NAME/config.json`` (no weights, no tokenizer): it stands for MODEL and
implies ``--load-format dummy --skip-tokenizer-init``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: shipped benchmark model configs, one directory per preset
BENCH_MODELS_DIR = Path(__file__).parent / "bench_models"


def model_presets() -> list[str]:
    """The names ``--model-preset`` accepts (directories of ``bench_models`` with a config)."""
    return sorted(p.parent.name for p in BENCH_MODELS_DIR.glob("*/config.json"))


def preset_dir(name: str) -> Path:
    """The directory of preset ``name``; ``ValueError`` listing the presets when unknown."""
    path = BENCH_MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(
            f"unknown --model-preset {name!r}; known: {', '.join(model_presets()) or '(none)'}"
        )
    return path


def add_parser(subparsers: Any) -> None:
    from chassis.serve.args import add_engine_args
    from chassis.serve.bench_sharegpt import add_dataset_args

    bench = subparsers.add_parser("bench", help="run a benchmark (throughput, latency, serve)")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a random-token workload")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=32, help="requests to run (default: 32)")
    tp.add_argument("--input-len", default="32:256", help="N or MIN:MAX (uniform); default 32:256")
    tp.add_argument("--output-len", default="32:128", help="N or MIN:MAX (uniform); default 32:128")
    add_dataset_args(tp, "tokenized by the engine's tokenizer")
    _add_common(tp)
    tp.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF generate batch size (default: all of HF's prompts in one padded batch)",
    )
    tp.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="HF runs only the first N prompts; chassis is then timed on those N too and the "
        "ratio compares the same requests (default: all prompts)",
    )
    tp.set_defaults(run=_run_offline)

    lat = kinds.add_parser("latency", help="end-to-end latency of one batch (default batch 1)")
    add_engine_args(lat)
    lat.add_argument("--input-len", default="128", help="prompt tokens per request (default: 128)")
    lat.add_argument("--output-len", default="256", help="output tokens per request (default: 256)")
    lat.add_argument(
        "--batch-size", type=int, default=1, help="requests generated together (default: 1)"
    )
    lat.add_argument(
        "--num-iters", type=int, default=3, help="timed generations, averaged (default: 3)"
    )
    lat.add_argument(
        "--num-iters-warmup",
        type=int,
        default=1,
        help="untimed generations before them (default: 1)",
    )
    _add_common(lat)
    lat.set_defaults(run=_run_offline)

    from chassis.serve.bench_kernels import add_kernel_bench_parser
    from chassis.serve.bench_step import add_step_bench_parser

    add_step_bench_parser(kinds, add_engine_args)
    add_kernel_bench_parser(kinds)

    try:
        from chassis.serve.bench_serve import add_serve_bench_parser
    except ModuleNotFoundError as exc:
        if exc.name != "chassis.serve.bench_serve":
            raise
    else:
        add_serve_bench_parser(kinds)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-preset",
        default=None,
        metavar="NAME",
        help="a shipped model config instead of MODEL (random weights, no tokenizer); "
        f"known: {', '.join(model_presets())}",
    )
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

    try:
        if args.model_preset is not None:
            _apply_preset(args)
        config = engine_config_from_args(args)
        if args.bench_kind == "throughput":
            bench_offline.throughput(args, config)
        else:
            bench_offline.latency(args, config)
    except ValueError as exc:
        print(f"chassis bench: {exc}", file=sys.stderr)
        return 2
    return 0


def _apply_preset(args: argparse.Namespace) -> None:
    """Point MODEL at the preset's directory; it has no weights or tokenizer, so imply
    ``--load-format dummy --skip-tokenizer-init`` and refuse flags that contradict that."""
    if args.model or args.model_flag:
        raise ValueError("give either MODEL/--model or --model-preset, not both")
    if args.load_format not in (None, "dummy"):
        raise ValueError(
            f"--model-preset has no weights: it needs --load-format dummy, not {args.load_format}"
        )
    args.model = str(preset_dir(args.model_preset))
    args.load_format = "dummy"
    args.skip_tokenizer_init = True
