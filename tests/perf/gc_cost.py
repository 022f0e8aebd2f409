"""Time the cyclic garbage collector takes during decode steps (not a test).

    python tests/perf/tiny_config.py /tmp/tiny0 --layers 0
    python tests/perf/gc_cost.py /tmp/tiny0 nofreeze
    python tests/perf/gc_cost.py /tmp/tiny0 freeze

Builds the zero-layer model's engine with 256 requests of 64 prompt tokens, runs 1,500 decode
steps, and reports the time per step, the collector's time per step, and how many
collections of each generation ran (and their total ms), without or with
``gc.freeze()`` of the start-up heap (core/heap.py).
"""

from __future__ import annotations

import gc
import random
import sys
import time

from chassis.core.llm import LLM
from chassis.serve.bench_step import _requests


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    llm = LLM(directory, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=256)
    engine = llm.engine
    for request in _requests(llm, 256, 64, "d", random.Random(0)):
        engine.add_request(request)
    for _ in range(5):
        engine.step()
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    spent = [0.0, 0.0, 0.0]
    counts = [0, 0, 0]
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[info["generation"]] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    steps = 1500
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    print(
        f"{mode}: {total / steps * 1e3:.3f} ms per step; collector {sum(spent) / steps * 1e3:.3f} "
        f"ms per step; collections of generation 0/1/2: {counts}, "
        f"ms {[round(s * 1e3, 1) for s in spent]}"
    )


if __name__ == "__main__":
    main()
