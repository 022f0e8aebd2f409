"""How far an fp8 KV cache moves SmolLM2's greedy tokens (docs/performance.md, "FP8 KV
cache", the accuracy table).

Not a test. On the embedded SmolLM2-135M in bfloat16, ``torch_paged`` attention for every
engine so that only the cache differs::

    python tests/perf/fp8_kv_accuracy.py

First the ``auto`` (bfloat16) cache writes 64 greedy tokens (``ignore_eos``) for each of five
short prompts. Then, for ``fp8`` (e4m3) and ``fp8_e5m2``, it prints one line with:

- teacher-forced top-1 agreement: the fp8 engine scores each auto run's prompt + output with
  ``prompt_logprobs``; a generated position agrees when the fp8 engine's top-1 token there is
  the token the auto run generated (the share over all generated positions);
- free-running greedy: the fp8 engine generates from the same prompts; per prompt, the number
  of tokens equal to the auto run's before the first difference.

Engines run one after the other in this process, each shut down before the next starts.
Takes well under a minute on the 2-core CPU; the numbers do not depend on the machine's load.
"""

from __future__ import annotations

from chassis import LLM, SamplingParams
from chassis.core.gguf_checkpoint import embedded_model_dir

PROMPTS = [
    "The history of the printing press began",
    "To make a good cup of tea, you should",
    "The three largest planets in the solar system are",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 64
#: ``ignore_eos``: every prompt gets its 64 tokens (SmolLM2 ends some of these early)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
#: scoring only: one generated token, logprobs of every prompt position with the top-1
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


def engine(kv_cache_dtype: str) -> LLM:
    """The embedded SmolLM2 in bfloat16 with ``torch_paged`` and the given KV cache."""
    return LLM(
        str(embedded_model_dir()),
        dtype="bfloat16",
        attention_backend="torch_paged",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=1024,
    )


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens of ``a`` and ``b`` are equal."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def main() -> None:
    llm = engine("auto")
    reference = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    prompts = [list(out.prompt_token_ids) for out in reference]
    outputs = [list(out.outputs[0].token_ids) for out in reference]
    print(f"auto: {sum(len(o) for o in outputs)} generated tokens", flush=True)

    for kv_cache_dtype in ("fp8", "fp8_e5m2"):
        llm = engine(kv_cache_dtype)
        scored = llm.generate(
            [{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs, strict=True)], SCORE
        )
        agree = positions = 0
        for prompt, output, result in zip(prompts, outputs, scored, strict=True):
            entries = result.prompt_logprobs
            if entries is None:
                raise ValueError("the scoring run returned no prompt_logprobs")
            # Entry p holds the logprobs of token p given tokens < p: entries
            # len(prompt) .. len(prompt) + len(output) - 1 score the generated tokens.
            for j, token in enumerate(output):
                position = entries[len(prompt) + j]
                top1 = next(t for t, logprob in position.items() if logprob.rank == 1)
                agree += top1 == token
                positions += 1
        free = llm.generate(PROMPTS, GREEDY)
        llm.shutdown()
        prefixes = [
            equal_prefix(o, list(f.outputs[0].token_ids))
            for o, f in zip(outputs, free, strict=True)
        ]
        print(
            f"{kv_cache_dtype}: teacher-forced top-1 agreement {agree / positions:.1%}"
            f" ({agree}/{positions} positions); greedy tokens equal before the first"
            f" difference: {', '.join(map(str, prefixes))}",
            flush=True,
        )


if __name__ == "__main__":
    main()
