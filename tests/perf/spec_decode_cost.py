"""What n-gram speculative decoding gains on this host (docs/scheduling.md).

Not a test. On the embedded SmolLM2::

    python tests/perf/spec_decode_cost.py [DTYPE]

(``DTYPE``: ``auto``, the default, runs SmolLM2 in bfloat16 on this CPU; ``float32``)

prints output tokens per second without and with ``--speculative-config
'{"num_speculative_tokens": 4}'`` on two workloads: chat requests that copy text (ask to
repeat a passage: the drafts are mostly right) and chat requests that write new text
(questions: few drafts, mostly wrong), each at 1 and 4 requests at a time, greedy, and the
copying requests sampled at temperature 0.7 (identical outputs are then not expected); plus
the share of drafts accepted. Both engines run in this process, alternated, each measured twice after a
warm-up (the better of the two counts). It also counts the outputs that are identical:
SmolLM2 runs in bfloat16 here, whose CPU kernels round differently for different numbers of
rows, so a near-tie can go another way when a step verifies drafts (plain decoding changes
the same way with the batch's composition); in float32 the outputs are identical
(tests/test_speculative_decoding.py checks that).
"""

from __future__ import annotations

import sys
import time

from chassis import LLM, SamplingParams

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. All that glitters is not gold. Actions speak louder than words. Where "
    "there is a will, there is a way. Knowledge is power, and time is money."
)
COPY = [f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"]
NEW = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Give three tips for learning to cook.",
    "Describe the water cycle for a child.",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=96)
#: sampled (unseeded), for the acceptance of drafts checked by exact match with a sample
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=96)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def run(
    llm: LLM, prompts: list[str], params: SamplingParams = PARAMS
) -> tuple[list[list[int]], float]:
    messages = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outputs = llm.chat(messages, params)
    elapsed = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outputs], elapsed


def main(dtype: str = "auto") -> None:
    engines = {
        "plain": LLM(max_model_len=1024, dtype=dtype),
        "ngram-4": LLM(max_model_len=1024, dtype=dtype, speculative_config=SPEC),
    }
    copies = [COPY[0].replace("exactly", f"exactly ({i})") for i in range(4)]
    workloads = {
        "copy x1": (COPY, PARAMS),
        "copy x4": (copies, PARAMS),
        "new x1": (NEW[:1], PARAMS),
        "new x4": (NEW, PARAMS),
        "copy x4, sampled": (copies, SAMPLED),
    }
    for label, (prompts, params) in workloads.items():
        results: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        stats_before = {n: e.engine.scheduler.stats() for n, e in engines.items()}
        for llm in engines.values():
            run(llm, prompts, params)  # warm-up
        for _ in range(2):
            for name, llm in engines.items():
                ids, elapsed = run(llm, prompts, params)
                tokens[name] = ids
                results[name].append(sum(len(t) for t in ids) / elapsed)
        same = sum(a == b for a, b in zip(tokens["plain"], tokens["ngram-4"], strict=True))
        after = engines["ngram-4"].engine.scheduler.stats()
        before = stats_before["ngram-4"]
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        plain, spec = max(results["plain"]), max(results["ngram-4"])
        share = f"{accepted / drafted:.0%}" if drafted else "n/a"
        print(
            f"{label}: plain {plain:.1f} tok/s, ngram-4 {spec:.1f} tok/s "
            f"({spec / plain:.2f}x); drafts accepted {accepted}/{drafted} ({share}); "
            f"{sum(len(t) for t in tokens['plain'])} output tokens per run; "
            f"{same} of {len(prompts)} outputs identical"
        )


if __name__ == "__main__":
    main(*sys.argv[1:2])
