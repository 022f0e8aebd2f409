"""What sleep mode frees on the CPU: process RSS around ``LLM.sleep`` and ``wake_up``.

Not a test. ``python tests/perf/sleep_rss.py`` runs the embedded SmolLM2-135M-Instruct in
this process (``LLM``, bf16 where the CPU has it, ``--kv-cache-memory 1GiB``) and prints the
resident set size (``VmRSS``) after a workload that writes every KV block (distinct random
prompts whose tokens add up to the cache's capacity: the CPU's KV cache is committed page by
page as it is written), after ``sleep(1)``, after waking up, after ``sleep(2)``, after waking
up again, and after the workload once more. docs/serving.md, "Sleep mode", has the numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

from chassis import LLM, SamplingParams


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def fill_kv_cache(llm: LLM, prompt_len: int, seed: int) -> float:
    """Run distinct random prompts whose tokens add up to the KV cache's capacity; seconds."""
    info = llm.engine.info
    num_prompts = max(1, info.kv_capacity_tokens // (prompt_len + 1))
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49_000) for _ in range(prompt_len)] for _ in range(num_prompts)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    from chassis.serve.args import parse_memory_size

    llm = LLM(
        None,
        max_model_len=args.prompt_len + 16,
        kv_cache_memory=parse_memory_size(args.kv_cache_memory),
        enable_sleep_mode=True,
    )
    check = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    question = "The capital of France is"
    expected = llm.generate(question, check)[0].outputs[0].token_ids

    def report(what: str) -> None:
        gc.collect()
        print(f"{what:<42} {rss_mib():7.0f} MiB", flush=True)

    seconds = fill_kv_cache(llm, args.prompt_len, seed=0)
    report(f"loaded, KV cache written ({seconds:.0f} s)")
    for level in (1, 2):
        llm.sleep(level)
        report(f"after sleep(level={level})")
        llm.wake_up()
        report("after wake_up() (KV cache not written yet)")
        assert llm.generate(question, check)[0].outputs[0].token_ids == expected
    seconds = fill_kv_cache(llm, args.prompt_len, seed=1)
    report(f"KV cache written again ({seconds:.0f} s)")
    text = llm.get_tokenizer().decode(expected)
    print(f"greedy tokens unchanged after each wake-up: {question!r} -> {text!r}")


if __name__ == "__main__":
    main()
