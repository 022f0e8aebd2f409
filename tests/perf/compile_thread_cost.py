"""Why structured-output constraints compile on the engine core's thread (docs/structured_outputs.md).

Not a test. On the embedded SmolLM2::

    python tests/perf/compile_thread_cost.py

Moving a constraint's compilation to a worker thread would stop it from holding the running
requests' steps for its whole duration, but the built-in compiler is pure Python: it holds
the GIL, and the engine thread, which releases the GIL in every torch op, waits up to the
interpreter's switch interval (5 ms) to take it back after each one (the "convoy effect").
This script measures, with 8 requests decoding: their step time alone; how long a new
12,000-choice constraint's compile and first mask hold the engine thread (today's design:
the gap between two steps); and, with the same work in a worker thread, how long it takes
there and how long the steps that run meanwhile take.
"""

from __future__ import annotations

import statistics
import threading
import time

from chassis import LLM, SamplingParams
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.structured_output import StructuredOutputsParams

STEPS = 30
#: strings in the constraint compiled while the requests decode
SIZE = 12_000
PROMPTS = [f"Write a long story about the number {i}." for i in range(8)]


def constraint(i: int, size: int) -> StructuredOutputsParams:
    """A ``size``-string choice no backend has compiled yet (a new key each time)."""
    return StructuredOutputsParams(choice=[f"o{i}-{k}" for k in range(size)])


def start_requests(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        (request,) = llm.input_processor.process(prompt, params, f"r{i}")
        llm.engine.add_request(request)
    for _ in range(3):  # prefills done: every later step is 8 decodes
        llm.engine.step()


def main() -> None:
    llm = LLM(str(embedded_model_dir()), max_model_len=2048, enable_prefix_caching=False)
    backend = llm.engine.structured_outputs.backend
    start_requests(llm)
    counter = iter(range(10**6))

    def compile_one(size: int) -> float:
        start = time.perf_counter()
        backend.compile(constraint(next(counter), size)).matcher().allowed_tokens()
        return (time.perf_counter() - start) * 1e3

    for _ in range(3):
        compile_one(SIZE)  # warm: the vocabulary's tables are built once
    alone = []
    for _ in range(STEPS):
        start = time.perf_counter()
        llm.engine.step()
        alone.append((time.perf_counter() - start) * 1e3)
    print(f"decode step of 8 requests, alone: median {statistics.median(alone):.1f} ms")

    inline = [compile_one(SIZE) for _ in range(3)]
    print(
        f"a {SIZE:,}-choice compile + first mask on the engine thread: median "
        f"{statistics.median(inline):.0f} ms, the longest gap between two steps"
    )

    for trial in range(3):
        done = threading.Event()
        elapsed: list[float] = []

        def work(elapsed: list[float] = elapsed, done: threading.Event = done) -> None:
            elapsed.append(compile_one(SIZE))
            done.set()

        worker = threading.Thread(target=work)
        steps = []
        worker.start()
        while not done.is_set():
            start = time.perf_counter()
            llm.engine.step()
            steps.append((time.perf_counter() - start) * 1e3)
        worker.join()
        print(
            f"in a worker thread (trial {trial + 1}): the compile took {elapsed[0]:.0f} ms; "
            f"{len(steps)} steps ran meanwhile, median {statistics.median(steps):.1f} ms, "
            f"longest {max(steps):.1f} ms"
        )


if __name__ == "__main__":
    main()
