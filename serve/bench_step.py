"""``chassis bench step``: the time of one engine step, for profiling the hot path.

For each ``--batch-size``, fills the engine with that many requests of ``--context-len``
random prompt tokens, runs their prefill, then times decode steps (``EngineCore.step()``, one
token per request) and, with ``--prefill-tokens``, one prefill step of that many tokens.
Prints the median of ``--repeats`` timings of ``--num-steps`` steps each.

``--profile`` adds, per batch size, where a decode step's time goes
(:mod:`chassis.serve.step_profile`): host time per engine-core call, and under
``torch.profiler`` the device's busy time per step and the top kernels (the top CPU ops on a
host-only platform). ``--profile-dir`` also writes a Chrome trace per batch size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def add_step_bench_parser(kinds: Any, add_engine_args: Any) -> None:
    p = kinds.add_parser("step", help="time decode (and prefill) engine steps")
    add_engine_args(p)
    p.add_argument(
        "--batch-size", type=int, nargs="+", default=[1], help="decode batch sizes to time"
    )
    p.add_argument("--context-len", type=int, default=150, help="prompt tokens per request")
    p.add_argument(
        "--num-steps", type=int, default=10, help="steps per timing, averaged (default: 10)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timings per batch size; the median (default: 3)"
    )
    p.add_argument("--prefill-tokens", type=int, default=0, help="also time one prefill step")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also show host time per engine-core call, device busy time and top kernels",
    )
    p.add_argument(
        "--profile-dir", type=Path, help="with --profile: write a Chrome trace per batch size here"
    )
    p.set_defaults(run=run)


def _requests(llm: Any, count: int, length: int, tag: str, rng: random.Random) -> list[Any]:
    from chassis.core.sampling_params import SamplingParams

    # max_tokens None: the rest of the context, so no request ends while being timed
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    vocab = llm.input_processor.vocab_size
    low, high = min(1000, vocab // 4), min(40000, vocab)  # ordinary tokens of any vocabulary
    out = []
    for i in range(count):
        ids = [rng.randrange(low, high) for _ in range(length)]
        out += llm.input_processor.process(ids, params, f"{tag}{i}")
    return out


def run(args: argparse.Namespace) -> int:
    from chassis.core.llm import LLM
    from chassis.serve.args import engine_config_from_args

    try:
        if any(b < 1 for b in args.batch_size):
            raise ValueError(f"--batch-size values must be >= 1; got {args.batch_size}")
        config = engine_config_from_args(args)
    except ValueError as exc:  # invalid or disagreeing flags, as the other benchmarks
        print(f"chassis bench: {exc}", file=sys.stderr)
        return 2
    llm = LLM(**config.to_dict())
    rng = random.Random(0)
    for batch_size in args.batch_size:
        _decode_steps(llm, args, batch_size, rng)
    if args.prefill_tokens:
        _prefill_step(llm, args, rng)
    return 0


def _decode_steps(llm: Any, args: argparse.Namespace, batch_size: int, rng: random.Random) -> None:
    from chassis.core.heap import frozen_heap
    from chassis.platforms import get_current_platform

    engine = llm.engine
    requests = _requests(llm, batch_size, args.context_len, f"decode{batch_size}-", rng)
    for request in requests:
        engine.add_request(request)
    pending = {r.request_id for r in requests}
    while pending:  # prefill until every request has produced its first token
        pending -= {o.request_id for o in engine.step().outputs if o.new_token_ids}
    for _ in range(3):  # warm up the decode path
        engine.step()
    platform = get_current_platform()
    timings = []
    with frozen_heap():  # no 100 ms full collection inside the timed steps
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.num_steps):
                engine.step()
            platform.synchronize()  # under async scheduling the last step may still run
            timings.append((time.perf_counter() - start) / args.num_steps)
    decode_ms = statistics.median(timings) * 1e3
    print(f"decode step, batch {batch_size}, context ~{args.context_len}: {decode_ms:.1f} ms")
    if args.profile:
        from chassis.serve.step_profile import profile_steps, time_phases

        for line in time_phases(engine, args.num_steps).lines():
            print(line)
        trace = args.profile_dir / f"trace_batch{batch_size}.json" if args.profile_dir else None
        for line in profile_steps(engine, args.num_steps, trace_path=trace).lines():
            print(line)
    engine.abort_requests([r.request_id for r in requests])
    while engine.has_unfinished():
        engine.step()


def _prefill_step(llm: Any, args: argparse.Namespace, rng: random.Random) -> None:
    engine = llm.engine
    prefill = []
    for attempt in range(args.repeats + 1):  # the first one warms up buffers of that size
        (request,) = _requests(llm, 1, args.prefill_tokens, f"prefill{attempt}-", rng)
        engine.add_request(request)
        start = time.perf_counter()
        engine.step()
        prefill.append(time.perf_counter() - start)
        engine.abort_requests([request.request_id])
        while engine.has_unfinished():
            engine.step()
    prefill_ms = statistics.median(prefill[1:]) * 1e3
    print(f"prefill step, {args.prefill_tokens} tokens in one request: {prefill_ms:.0f} ms")
