"""What tensor parallelism adds to a decode step on this host (docs/performance.md).

Not a test. Runs 32 greedy requests of 64 tokens on a tiny config (random weights), once with
one rank and once with ``--tensor-parallel-size 2``, in separate processes, and prints the
time per decode step of each::

    python tests/perf/tiny_config.py /tmp/tiny --layers 2
    python tests/perf/tp_step_cost.py /tmp/tiny 1; python tests/perf/tp_step_cost.py /tmp/tiny 2
"""

from __future__ import annotations

import argparse
import time

from chassis import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a config directory (tests/perf/tiny_config.py)")
    parser.add_argument("tensor_parallel_size", type=int)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=256,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(
        f"tp={args.tensor_parallel_size}: 32 requests x 64 tokens in {elapsed:.2f} s, "
        f"{32 * 64 / elapsed:.0f} tok/s, {elapsed / 64 * 1000:.1f} ms per decode step"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
