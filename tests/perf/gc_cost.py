"""Time the cyclic garbage collector takes during decode steps (not a test).

    python tests/perf/tiny_config.py /tmp/tiny0 --layers 0
    python tests/perf/gc_cost.py /tmp/tiny0 nofreeze
    python tests/perf/gc_cost.py /tmp/tiny0 freeze

Builds the zero-layer model's engine and runs four rounds of 256 requests of 64 prompt tokens:
each round's prefill is not timed, then 400 decode steps at batch 256 are (the model's 512
positions end the requests soon after). Reports the time per decode step, the collector's time
per step, and how many collections of each generation ran during the timed steps (and their
total ms), without or with ``gc.freeze()`` of the start-up heap (core/heap.py).
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
    rng = random.Random(0)
    spent = [0.0, 0.0, 0.0]
    counts = [0, 0, 0]
    started = [0.0]
    timing = [False]

    def on_gc(phase: str, info: dict) -> None:
        if not timing[0]:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[info["generation"]] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    rounds, steps_per_round, total = 4, 400, 0.0
    for round_index in range(rounds):
        requests = _requests(llm, 256, 64, f"r{round_index}-", rng)
        for request in requests:
            engine.add_request(request)
        pending = {r.request_id for r in requests}
        while pending:  # prefill, untimed
            pending -= {o.request_id for o in engine.step().outputs if o.new_token_ids}
        if round_index == 0 and mode == "freeze":
            gc.collect()
            gc.freeze()
        timing[0] = True
        start = time.perf_counter()
        for _ in range(steps_per_round):
            engine.step()
        total += time.perf_counter() - start
        timing[0] = False
        engine.abort_requests([r.request_id for r in requests])
        while engine.has_unfinished():
            engine.step()
    gc.callbacks.remove(on_gc)
    steps = rounds * steps_per_round
    print(
        f"{mode}: {total / steps * 1e3:.3f} ms per decode step; collector "
        f"{sum(spent) / steps * 1e3:.3f} ms per step; collections of generation 0/1/2 during "
        f"the {steps} timed steps: {counts}, ms {[round(s * 1e3, 1) for s in spent]}"
    )


if __name__ == "__main__":
    main()
