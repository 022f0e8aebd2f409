"""``chassis bench step``: the time of one engine step, for profiling the hot path.

Fills the engine with ``--batch-size`` requests of ``--context-len`` random prompt tokens,
runs their prefill, then times decode steps (``EngineCore.step()``, one token per request)
and, with ``--prefill-tokens``, one prefill step of that many tokens. Prints the median of
``--repeats`` timings of ``--num-steps`` steps each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any


def add_step_bench_parser(kinds: Any, add_engine_args: Any) -> None:
    p = kinds.add_parser("step", help="time decode (and prefill) engine steps")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context-len", type=int, default=150, help="prompt tokens per request")
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=0, help="also time one prefill step")
    p.set_defaults(run=run)


def _requests(llm: Any, count: int, length: int, tag: str, rng: random.Random) -> list[Any]:
    from chassis.core.sampling_params import SamplingParams

    # max_tokens None: the rest of the context, so no request ends while being timed
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = []
    for i in range(count):
        ids = [rng.randrange(1000, 40000) for _ in range(length)]
        out += llm.input_processor.process(ids, params, f"{tag}{i}")
    return out


def run(args: argparse.Namespace) -> int:
    from chassis.core.llm import LLM
    from chassis.serve.args import engine_config_from_args

    config = engine_config_from_args(args)
    llm = LLM(**config.to_dict())
    engine, rng = llm.engine, random.Random(0)
    requests = _requests(llm, args.batch_size, args.context_len, "decode", rng)
    for request in requests:
        engine.add_request(request)
    pending = {r.request_id for r in requests}
    while pending:  # prefill until every request has produced its first token
        pending -= {o.request_id for o in engine.step().outputs if o.new_token_ids}
    for _ in range(3):  # warm up the decode path
        engine.step()
    timings = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.num_steps):
            engine.step()
        timings.append((time.perf_counter() - start) / args.num_steps)
    decode_ms = statistics.median(timings) * 1e3
    print(f"decode step, batch {args.batch_size}, context ~{args.context_len}: {decode_ms:.1f} ms")
    engine.abort_requests([r.request_id for r in requests])
    engine.step()
    if args.prefill_tokens:
        prefill = []
        for attempt in range(args.repeats + 1):  # the first one warms up buffers of that size
            (request,) = _requests(llm, 1, args.prefill_tokens, f"prefill{attempt}-", rng)
            engine.add_request(request)
            start = time.perf_counter()
            engine.step()
            prefill.append(time.perf_counter() - start)
            engine.abort_requests([request.request_id])
            engine.step()
        prefill_ms = statistics.median(prefill[1:]) * 1e3
        print(f"prefill step, {args.prefill_tokens} tokens in one request: {prefill_ms:.0f} ms")
    return 0
