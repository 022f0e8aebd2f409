"""FP8 checkpoints (block-scaled ``fp8`` and llm-compressor's ``compressed-tensors``) load
dequantized: the engine's tokens equal HF's on the dequantized twin of the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import hf_greedy
from safetensors.torch import load_file, save_file

from chassis import LLM, SamplingParams
from chassis.core.quantized_weights import dequantized_weights

FP8_MAX = 448.0
PROMPTS = [[1, 422, 3108, 314, 9216, 253, 1345], [1, 88, 913, 402, 1033, 77, 5, 811, 64, 90]]
NEW_TOKENS = 10
Tokens = list[list[int]]


def greedy_on_twin_and_checkpoint(twin: Path, quantized: Path) -> tuple[Any, Tokens, Tokens]:
    """HF's float32 model of the dequantized ``twin``, its greedy tokens for PROMPTS
    (NEW_TOKENS each) and the engine's from the ``quantized`` checkpoint, also float32."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(str(quantized), dtype="float32", max_model_len=64, num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    return reference, expected, got


def copy_stating(source: Path, model_dir: Path, quantization_config: dict) -> None:
    """Copy checkpoint ``source`` to ``model_dir`` with ``quantization_config`` in its
    config.json (the weights stay as they are)."""
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and ".layers." in name and name.endswith("_proj.weight")


def _quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float8 values, the scale stored with them, and the scale expanded to the weight's
    shape (the test's own dequantization, independent of the code under test)."""
    if layout == "block":
        rows, cols = 32, 32
        grid = weight.unflatten(0, (-1, rows)).unflatten(2, (-1, cols))  # [R, 32, C, 32]
        scale = grid.abs().amax(dim=(1, 3)) / FP8_MAX
        expanded = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    elif layout == "row":
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        expanded = scale.expand_as(weight)
    else:  # tensor
        scale = weight.abs().amax().reshape(1) / FP8_MAX
        expanded = scale.expand_as(weight)
    return (weight / expanded).to(torch.float8_e4m3fn), scale.float(), expanded


def write_fp8_twins(source: Path, root: Path, layout: str) -> tuple[Path, Path]:
    """An FP8 copy of ``source`` in ``layout`` and its dequantized float32 twin."""
    quantized, twin = root / f"fp8-{layout}", root / f"twin-{layout}"
    for directory in (quantized, twin):
        shutil.copytree(source, directory)
    tensors = load_file(str(source / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_quantized(name, tensor):
            fp8[name] = dequantized[name] = tensor
            continue
        values, scale, expanded = _quantize(tensor, layout)
        fp8[name] = values
        fp8[name + ("_scale_inv" if layout == "block" else "_scale")] = scale
        if layout == "row":  # llm-compressor keeps a static activation scale: ignored
            fp8[name.removesuffix(".weight") + ".input_scale"] = torch.ones(1)
        dequantized[name] = values.float() * expanded
    save_file(fp8, str(quantized / "model.safetensors"))
    save_file(dequantized, str(twin / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = _config(layout).quantization_config
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


def _config(layout: str) -> object:
    if layout == "row":
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"format": "float-quantized", "targets": ["Linear"]}},
            "ignore": ["lm_head"],
        }
    else:
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if layout == "block":
            quant["weight_block_size"] = [32, 32]
    return type("Config", (), {"quantization_config": quant})()


@pytest.mark.parametrize("layout", ["block", "row", "tensor"])
def test_fp8_checkpoint_runs_as_its_dequantized_twin(
    tiny_llama_dir: Path, tmp_path: Path, layout: str
) -> None:
    quantized, twin = write_fp8_twins(tiny_llama_dir, tmp_path, layout)
    reference, expected, got = greedy_on_twin_and_checkpoint(twin, quantized)
    assert got == expected
    from transformers import AutoModelForCausalLM

    # the twin is not the original: float8 rounding changed the weights
    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(reference.parameters(), original.parameters(), strict=True)
    )


def test_the_quantization_flag_is_checked_against_the_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """vLLM's --quantization: the checkpoint's own method runs (same tokens as without the
    flag); another method, or any for an unquantized checkpoint, is refused before loading."""
    quantized, _ = write_fp8_twins(tiny_llama_dir, tmp_path, "tensor")
    settings = {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 16}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    flagged = LLM(str(quantized), quantization="FP8", **settings)
    plain = LLM(str(quantized), **settings)
    assert (
        flagged.generate("Checked", params)[0].outputs[0].token_ids
        == plain.generate("Checked", params)[0].outputs[0].token_ids
    )
    flagged.shutdown()
    plain.shutdown()
    with pytest.raises(ValueError, match=r"--quantization awq_marlin does not match .* 'fp8'"):
        LLM(str(quantized), quantization="awq_marlin", **settings)
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint is not quantized"):
        LLM(str(tiny_llama_dir), quantization="fp8", **settings)


def test_other_quantization_methods_are_refused_before_loading(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "bnb"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes'"):
        LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'pack-quantized'"):
        LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_a_float8_weight_without_its_scale_is_refused() -> None:
    config = _config("tensor")
    weight = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="without a scale"):
        list(dequantized_weights([("a.weight", weight)], config))
    with pytest.raises(ValueError, match="scales without"):
        list(dequantized_weights([("a.weight_scale", torch.ones(1))], config))
    with pytest.raises(ValueError, match="cannot apply a scale"):
        list(dequantized_weights([("a.weight", weight), ("a.weight_scale", torch.ones(3))], config))
    # the scale may come first
    pairs = [
        ("a.weight_scale", torch.full((1,), 2.0)),
        ("a.weight", torch.ones(2, 2).to(weight.dtype)),
    ]
    assert torch.equal(
        dict(dequantized_weights(pairs, config))["a.weight"], torch.full((2, 2), 2.0)
    )
