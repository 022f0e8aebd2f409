"""What draft-model speculative decoding costs and gains on this host (docs/scheduling.md,
"Draft-model drafts").

Not a test. On the embedded SmolLM2 (30 layers) as the target::

    python tests/perf/draft_model_cost.py [DTYPE]

(``DTYPE``: ``float32``, the default, where greedy outputs must be identical; ``auto`` runs
SmolLM2 in bfloat16 on this CPU, where a near-tie may resolve differently in a verify step)

prints, per workload (chat requests that copy a passage, and ones that write new text, 1 and
4 at a time, greedy, 96 tokens), the output tokens per second, the engine steps and the share
of drafts accepted without a draft and with three, ``num_speculative_tokens`` 4:

- ``first-6``: SmolLM2's first 6 layers with its final norm and (tied) head, written to a
  temporary folder: a cheap draft from the target's own weights (an untrained early exit,
  which rarely agrees: about 1 % of its drafts on a first 32-token copy run);
- ``self``: SmolLM2 drafting for itself: every draft accepted, the steps drop by about 5,
  each step costs about twice (the upper bound on acceptance, the lower one on cost);
- ``tiny``: a random 2-layer, hidden-64 model with SmolLM2's vocabulary: drafts are almost
  never accepted, so it shows the overhead of drafting and verifying alone.

Each engine is warmed up, then measured twice (the better run counts); engines run one
after the other in this process. Run it on a quiet machine.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for its helpers
from fixtures_speculative import counting_steps

from chassis import LLM, SamplingParams
from chassis.core.gguf_checkpoint import embedded_model_dir

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. All that glitters is not gold. Actions speak louder than words. Where "
    "there is a will, there is a way. Knowledge is power, and time is money."
)
COPY = [f"Repeat the following text exactly ({i}), word for word:\n\n{PASSAGE}" for i in range(4)]
NEW = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Give three tips for learning to cook.",
    "Describe the water cycle for a child.",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=96)
K = 4


def first_layers(source: Path, num_layers: int, directory: Path) -> Path:
    """``source`` (a Llama-style checkpoint) cut to its first ``num_layers`` layers."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config))
    weights = load_file(source / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def tiny_draft(directory: Path) -> Path:
    """A random 2-layer, hidden-64 Llama with SmolLM2's vocabulary and tokenizer."""
    from fixtures_models import write_tiny_checkpoint

    return write_tiny_checkpoint("llama", directory, seed=1, max_position_embeddings=2048)


def run(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], float, int]:
    """Output ids, seconds and engine steps of one batch of chat requests."""
    messages = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    with counting_steps(llm) as steps:
        outputs = llm.chat(messages, PARAMS)
    elapsed = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outputs], elapsed, steps[0]


def main(dtype: str = "float32") -> None:
    target = embedded_model_dir()
    scratch = Path(tempfile.mkdtemp(prefix="chassis-draft-"))
    try:
        drafts = {
            "first-6": first_layers(target, 6, scratch / "first6"),
            "self": target,
            "tiny": tiny_draft(scratch / "tiny"),
        }
        engines = {"plain": LLM(str(target), max_model_len=1024, dtype=dtype)}
        for name, path in drafts.items():
            spec = {"model": str(path), "num_speculative_tokens": K}
            engines[name] = LLM(
                str(target), max_model_len=1024, dtype=dtype, speculative_config=spec
            )
        workloads = {"copy x1": COPY[:1], "copy x4": COPY, "new x1": NEW[:1], "new x4": NEW}
        for label, prompts in workloads.items():
            line = [f"{label}:"]
            reference: list[list[int]] | None = None
            for name, llm in engines.items():
                before = llm.engine.scheduler.stats()
                run(llm, prompts)  # warm-up
                best = 0.0
                for _ in range(2):
                    ids, elapsed, steps = run(llm, prompts)
                    best = max(best, sum(len(t) for t in ids) / elapsed)
                after = llm.engine.scheduler.stats()
                drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                if reference is None:
                    reference = ids
                same = sum(a == b for a, b in zip(reference, ids, strict=True))
                share = f", accepted {accepted / drafted:.0%}" if drafted else ""
                line.append(
                    f"{name} {best:.1f} tok/s in {steps} steps{share}"
                    f" ({same}/{len(prompts)} identical)"
                )
            print("; ".join(line), flush=True)
        for llm in engines.values():
            llm.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
