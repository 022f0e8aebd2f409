"""How many drafts a draft model gets accepted for sampled requests: probabilistic drafts
(rejection sampling, ``draft_sampling: "probabilistic"``) against one-hot ones (the draft's
argmax, verified by exact match, ``"greedy"``). docs/scheduling.md, "Draft-model drafts".

Not a test, and no timing (it counts drafts, so it can run on a busy machine). On the
embedded SmolLM2 in float32 as the target::

    python tests/perf/draft_acceptance.py

prints, per draft and temperature (1.0 and 0.7, no top-k/top-p), the share of drafts
accepted and the tokens per engine step over the 8 chat requests of
``tests/perf/draft_model_cost.py`` (4 that copy a passage, 4 that write new text), 64
tokens each, ``num_speculative_tokens`` 4, engine seed 0:

- ``self``: SmolLM2 drafting for itself (q == p: every probabilistic draft is accepted,
  a one-hot draft only as often as the sample is the argmax);
- ``noisy``: SmolLM2 with Gaussian noise of 0.15 times each weight tensor's standard
  deviation added (a draft that agrees with the target often, not always);
- ``first-6``: SmolLM2's first 6 layers with its norm and head (an untrained early exit).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_model_cost import COPY, NEW, first_layers  # also puts tests/ on the path
from fixtures_speculative import counting_steps

from chassis import LLM, SamplingParams
from chassis.core.gguf_checkpoint import embedded_model_dir

K = 4
MAX_TOKENS = 64
NOISE = 0.15


def noisy_copy(source: Path, directory: Path, scale: float) -> Path:
    """``source`` with ``scale`` times each tensor's standard deviation of noise added."""
    shutil.copytree(source, directory)
    weights = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    noisy = {
        name: t + scale * t.float().std() * torch.randn(t.shape, generator=generator)
        if t.numel() > 1
        else t
        for name, t in weights.items()
    }
    save_file(noisy, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def measure(llm: LLM, temperature: float) -> tuple[float, float]:
    """Share of drafts accepted and output tokens per engine step, for the 8 requests."""
    before = llm.engine.scheduler.stats()
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    with counting_steps(llm) as steps:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in COPY + NEW], params)
    after = llm.engine.scheduler.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return accepted / max(drafted, 1), tokens / steps[0]


def main() -> None:
    target = embedded_model_dir()
    scratch = Path(tempfile.mkdtemp(prefix="chassis-acceptance-"))
    try:
        drafts = {
            "self": target,
            "noisy": noisy_copy(target, scratch / "noisy", NOISE),
            "first-6": first_layers(target, 6, scratch / "first6"),
        }
        for name, path in drafts.items():
            for temperature in (1.0, 0.7):
                line = [f"{name}, temperature {temperature}:"]
                for draft_sampling in ("probabilistic", "greedy"):
                    spec = {
                        "model": str(path),
                        "num_speculative_tokens": K,
                        "draft_sampling": draft_sampling,
                    }
                    llm = LLM(
                        str(target),
                        dtype="float32",
                        max_model_len=1024,
                        num_kv_blocks=512,  # 8 requests of < 512 tokens; little memory
                        seed=0,
                        speculative_config=spec,
                    )
                    try:
                        share, per_step = measure(llm, temperature)
                    finally:
                        llm.shutdown()
                    line.append(
                        f"{draft_sampling} {share:.0%} accepted, {per_step:.2f} tokens/step"
                    )
                print(" ".join(line[:1]) + " " + "; ".join(line[1:]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
