"""Random PEFT-format LoRA adapters for tiny checkpoints, and their merged HF reference.

``write_peft_adapter`` saves what ``peft`` would (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A/B.weight``), with
random A and B (PEFT starts B at zero, which would make every adapter a no-op).
``hf_merged_model`` loads the base checkpoint in HF transformers and adds
``scaling * B @ A`` to each adapted weight: the reference a LoRA engine must match.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["ALL_TARGETS", "hf_greedy", "hf_merged_model", "write_peft_adapter"]

#: every projection of a Llama-style decoder layer
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    directory: Path,
    base_dir: Path,
    *,
    targets: tuple[str, ...] = ALL_TARGETS,
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 0,
    magnitude: float = 0.2,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Save a random LoRA adapter for the HF model in ``base_dir`` to ``directory``.

    Every linear module whose last name part is in ``targets`` is adapted (all layers).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] not in targets:
            continue
        out_features, in_features = module.weight.shape
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = (
            torch.randn(rank, in_features, generator=generator) * magnitude
        )
        tensors[f"{prefix}.lora_B.weight"] = (
            torch.randn(out_features, rank, generator=generator) * magnitude
        )
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": use_rslora,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base_dir),
        **(config_overrides or {}),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def hf_merged_model(
    base_dir: Path, adapter_dir: Path | None, load: Callable[[Path], Any] | None = None
) -> Any:
    """The HF float32 model of ``base_dir`` with the adapter's deltas added to its weights
    (the base model when ``adapter_dir`` is None). ``load`` builds the HF model from
    ``base_dir`` (default: ``AutoModelForCausalLM`` in float32; Gemma 2 needs eager
    attention, ``test_gemma_models.load_hf``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if load is None:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    else:
        model = load(base_dir)
    if adapter_dir is None:
        return model
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            rank = a.shape[0]
            alpha = config["lora_alpha"]
            scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            model.get_submodule(name).weight += scaling * (b @ a)
    return model


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of ``prompt_ids`` (new tokens only; EOS ignored)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def lora_engine(model_dir: Path, **overrides: Any) -> Any:
    """A small float32 offline engine over ``model_dir`` with LoRA on (``overrides``: any
    other ``LLM`` settings, e.g. ``max_loras``)."""
    from chassis import LLM

    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 128,
        "num_kv_blocks": 64,
        "block_size": 16,
        "enable_lora": True,
        "max_num_seqs": 8,
    }
    return LLM(str(model_dir), **{**settings, **overrides})


def greedy_with_adapters(
    llm: Any, loras: list[Any], prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """``llm``'s greedy continuations (``new_tokens`` each, EOS ignored) of the token-id
    ``prompts``, each under its ``loras`` entry (a ``LoRARequest``, or ``None``: the base)."""
    from chassis import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]
