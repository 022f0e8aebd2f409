"""Host time of the n-gram draft proposer per request and step, by context length
(docs/scheduling.md, speculative decoding).

Not a test. ::

    python tests/perf/ngram_proposer_cost.py [--sizes 512,4096,16384,65536] [--seconds 1]

For each context length, a token stream of random ids (a 32,000-token vocabulary) in which
about half the text repeats earlier passages of 16–256 tokens (quoted or edited text) is the
prompt; the request then decodes one token of the same stream per step, with the default
``--speculative-config`` (4 drafts, n-grams of 4 down to 2). Per step it times:

- ``propose_ngram``: what the scheduler called until this change (the request's
  ``all_token_ids``, a new list of prompt + output, scanned for every ``n``);
- ``NgramIndex``: the incremental index the scheduler keeps per request (feed the new
  token, look up the suffix).

Both run in this process on the same steps (the old one for about ``--seconds`` per size,
the new one for the same steps), and every step's drafts are checked to be equal. It also
prints the one-time cost of indexing the prompt (the first step that drafts pays it) and
the index's memory (``tracemalloc``), after a short warm-up at 512 tokens.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from chassis.core.speculative import NgramIndex, SpeculativeConfig, propose_ngram

VOCAB = 32000
MAX_STEPS = 4000


def token_stream(length: int, seed: int = 0) -> list[int]:
    """Random ids where about half the text copies an earlier passage of 16–256 tokens."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        size = rng.randint(16, 256)
        if len(tokens) > size and rng.random() < 0.5:
            start = rng.randrange(len(tokens) - size)
            tokens += tokens[start : start + size]
        else:
            tokens += [rng.randrange(VOCAB) for _ in range(size)]
    return tokens[:length]


def measure(context: int, seconds: float, spec: SpeculativeConfig) -> dict[str, float]:
    """Per-step times (µs) of both proposers over the same decode steps at ``context``."""
    k, low, high = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
    stream = token_stream(context + MAX_STEPS)
    prompt = stream[:context]

    output: list[int] = []
    old: list[list[int]] = []
    start = time.perf_counter()
    while len(output) < MAX_STEPS and time.perf_counter() - start < seconds:
        old.append(propose_ngram(prompt + output, k, low, high))
        output.append(stream[context + len(output)])
    old_us = (time.perf_counter() - start) / len(old) * 1e6
    steps = len(old)

    index = NgramIndex(low, high)
    start = time.perf_counter()
    index.catch_up(prompt, [])
    build_ms = (time.perf_counter() - start) * 1e3
    output = []
    new: list[list[int]] = []
    start = time.perf_counter()
    for _ in range(steps):
        index.catch_up(prompt, output)
        new.append(index.propose(k))
        output.append(stream[context + len(output)])
    new_us = (time.perf_counter() - start) / steps * 1e6
    if new != old:
        raise RuntimeError(f"context {context}: the index's drafts differ from propose_ngram's")

    tracemalloc.start()
    index = NgramIndex(low, high)
    index.catch_up(prompt, [])
    memory_mb = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    return {
        "steps": steps,
        "drafted": sum(bool(d) for d in old) / steps,
        "old_us": old_us,
        "new_us": new_us,
        "build_ms": build_ms,
        "memory_mb": memory_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,4096,16384,65536")
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    spec = SpeculativeConfig()
    measure(512, 0.2, spec)  # warm-up (first calls, allocator)
    print(
        "context | steps | steps with drafts | propose_ngram µs/step | NgramIndex µs/step "
        "| index build ms | index MiB"
    )
    for context in (int(s) for s in args.sizes.split(",")):
        r = measure(context, args.seconds, spec)
        print(
            f"{context} | {r['steps']:.0f} | {r['drafted']:.0%} | {r['old_us']:.1f} | "
            f"{r['new_us']:.1f} | {r['build_ms']:.1f} | {r['memory_mb']:.1f}"
        )


if __name__ == "__main__":
    main()
