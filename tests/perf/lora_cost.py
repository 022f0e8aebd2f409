"""What serving LoRA adapters costs on this host (docs/lora.md).

Not a test. On the embedded SmolLM2::

    python tests/perf/lora_cost.py [RANK] [BATCH]

(``RANK``: the adapters' rank, default 16; ``BATCH``: requests at a time, default 8)

writes two random PEFT adapters of ``RANK`` on every projection of every layer (shapes from
the engine's ``lora_target_shapes``), then prints output tokens per second, greedy, 64 new
tokens per request, for: the engine without ``--enable-lora``; with it, requests without an
adapter; every request with one adapter; half the requests with each of two adapters
(``--max-loras 2``). Every engine runs in this process, each workload measured twice after
a warm-up (the better of the two counts); the ratios are to the engine without LoRA. Also
prints how long the first request of an adapter waits for it to be read (from disk, once).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from chassis import LLM, LoRARequest, SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Give three tips for learning to cook.",
    "Describe the water cycle for a child.",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in shapes.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
        tensors[f"{key}.lora_B.weight"] = (
            torch.randn(out_features, rank, generator=generator) * 0.01
        )
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def tokens_per_second(llm: LLM, prompts: list[str], loras: list[LoRARequest | None]) -> float:
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, PARAMS, lora_request=loras)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return best


def main(rank: int = 16, batch: int = 8) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    plain = LLM(max_model_len=512)
    lora = LLM(max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=rank)
    shapes = lora.engine.info.lora_target_shapes
    assert shapes is not None
    with tempfile.TemporaryDirectory() as tmp:
        first = LoRARequest("first", 1, str(Path(tmp) / "first"))
        second = LoRARequest("second", 2, str(Path(tmp) / "second"))
        write_adapter(Path(first.lora_path), shapes, rank, seed=1)
        write_adapter(Path(second.lora_path), shapes, rank, seed=2)
        print(f"SmolLM2-135M, {len(shapes)} adapted projections, rank {rank}, batch {batch}")
        start = time.perf_counter()
        lora.generate(prompts[:1], SamplingParams(max_tokens=1), lora_request=first)
        print(f"first request of an adapter (reads it): {time.perf_counter() - start:.3f} s")
        plain.generate(prompts, PARAMS)  # warm-up
        half = [first, second] * (batch // 2) + [first] * (batch % 2)
        lora.generate(prompts, PARAMS, lora_request=half)
        results = {
            "no --enable-lora": tokens_per_second(plain, prompts, [None] * batch),
            "--enable-lora, no adapter": tokens_per_second(lora, prompts, [None] * batch),
            "one adapter": tokens_per_second(lora, prompts, [first] * batch),
            "two adapters, half each": tokens_per_second(lora, prompts, half),
        }
    reference = results["no --enable-lora"]
    for name, value in results.items():
        print(f"{name:28s} {value:8.1f} tok/s  {value / reference:5.2f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
