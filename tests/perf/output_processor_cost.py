"""Time ``OutputProcessor.process_outputs`` per engine step: the offline front-end's cost.

Not a test. ``--requests`` requests each receive one new token per step for ``--steps``
steps; prints the mean time per step over the first 128, 512 and ``--steps`` steps (the cost
of cumulative outputs grows with the output length). Modes: ``cumulative`` (a full output
per request per step), ``delta`` (what is new, as the server streams), ``final`` (one output
when a request finishes: what ``LLM.generate`` asks for). ``--no-tokenizer``: ids only, as
the GPU benchmarks run (``--skip-tokenizer-init``)::

    python tests/perf/output_processor_cost.py --mode final --no-tokenizer
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    from chassis.core.gguf_checkpoint import embedded_model_dir
    from chassis.core.output_processor import OutputProcessor
    from chassis.core.request import EngineCoreOutput, EngineCoreOutputs
    from chassis.core.sampling_params import SamplingParams
    from chassis.core.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cumulative", "delta", "final"), default="final")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--no-tokenizer", action="store_true")
    args = parser.parse_args()

    tokenizer = None if args.no_tokenizer else load_tokenizer(embedded_model_dir())
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
    for i in range(args.requests):
        processor.add_request(
            str(i), None, [1, 2, 3], params, [str(i)], None, args.mode == "delta",
            final_only=args.mode == "final",
        )  # fmt: skip
    rng = random.Random(0)
    marks = sorted({min(128, args.steps), min(512, args.steps), args.steps})
    elapsed, means = 0.0, []
    for step in range(1, args.steps + 1):
        outputs = EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(request_id=str(i), new_token_ids=[rng.randrange(100, 40000)])
                for i in range(args.requests)
            ]
        )
        start = time.perf_counter()
        processor.process_outputs(outputs)
        elapsed += time.perf_counter() - start
        if step in marks:
            means.append(f"{elapsed / step * 1e3:.2f}")
    print(
        f"{args.mode}, {args.requests} requests, tokenizer {tokenizer is not None}: mean ms "
        f"per step over the first {' / '.join(map(str, marks))} steps: {' / '.join(means)}"
    )


if __name__ == "__main__":
    main()
