"""Where an engine's start-up goes (docs/development.md, "Engine start-up").

Not a test. In a fresh process::

    python tests/perf/engine_startup.py [--model DIR] [--max-model-len N] [--num-kv-blocks N]
        [--async-llm] [--profile]

imports ``chassis.LLM`` and builds ``LLM(model, dtype="float32")`` (the embedded SmolLM2 by
default, with the default KV cache size unless ``--num-kv-blocks`` is given) with one thread,
as the tests do, and prints the seconds of the import and of ``LLM(...)``; ``--async-llm``
builds ``AsyncLLM.from_engine_config`` instead (an engine core child process, the
front-end's tokenizer) after importing transformers, as a test process has it imported. ``--profile`` adds
the 40 cProfile entries of chassis's own functions (and the tokenizer's load) with the
most cumulative time: tokenizer load, hf config, model build, KV cache.
The VM's timings drift by tens of percent from run to run: compare variants alternately.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--async-llm", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py sets it
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    from chassis import LLM
    from chassis.core.gguf_checkpoint import embedded_model_dir

    model = args.model or str(embedded_model_dir())
    if args.async_llm:
        from transformers import AutoConfig

        from chassis.core.async_llm import AsyncLLM
        from chassis.core.config import EngineConfig

        AutoConfig.from_pretrained(model)  # the test process's imports
    imported = time.perf_counter()
    sizes = {"max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks}
    if args.async_llm:
        llm = AsyncLLM.from_engine_config(EngineConfig(model=model, dtype="float32", **sizes))
    else:
        llm = LLM(model, dtype="float32", **sizes)
    built = time.perf_counter()
    if profiler is not None:
        profiler.disable()
    what = "AsyncLLM" if args.async_llm else "LLM"
    print(f"imports: {imported - start:.2f} s; {what}({model!r}): {built - imported:.2f} s")
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(r"work/main|chassis|tokenization_auto|torch\.zeros", 40)
        print(out.getvalue())
    if isinstance(llm, LLM):
        llm.shutdown()
    else:
        llm.shutdown_sync()


if __name__ == "__main__":
    main()
