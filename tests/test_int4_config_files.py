"""AWQ and GPTQ checkpoints that state their quantization the older ways: AutoGPTQ's
``quantize_config.json`` and AutoAWQ's ``quant_config.json`` beside a ``config.json`` without
``quantization_config``, and AutoAWQ's ``w_bit``/``q_group_size`` spellings. They run as their
dequantized twins; configs that contradict each other are refused by name. Also: a GPTQ
``g_idx`` that reorders rows while ``desc_act`` is false is honoured.

The checkpoints come from test_int4_checkpoints' own packer (independent of the code under
test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_fp8_checkpoints import copy_stating, greedy_on_twin_and_checkpoint
from test_int4_checkpoints import SCHEMES, Scheme, _hf_config, _packed_module, write_int_twins

from chassis import LLM
from chassis.core.int_quant_config import checkpoint_int_config
from chassis.core.model_loader import load_hf_config
from chassis.core.packed_int_weights import packed_int_format
from chassis.core.quantized_weights import check_quantization, dequantized_weights

#: AutoGPTQ's quantize_config.json (no quant_method), act-order, 4-bit, groups of 32
AUTOGPTQ_FILE = {
    "bits": 4,
    "group_size": 32,
    "damp_percent": 0.01,
    "desc_act": True,
    "static_groups": False,
    "sym": False,
    "true_sequential": True,
    "model_name_or_path": None,
    "model_file_base_name": "model",
}
#: AutoAWQ's quant_config.json, older spellings
AUTOAWQ_FILE = {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}


def _move_config_to_file(model_dir: Path, file_name: str, stated: dict) -> None:
    """Drop config.json's quantization_config and state ``stated`` in ``file_name``."""
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / file_name).write_text(json.dumps(stated))


FILE_CASES = {
    "llama-autogptq-quantize-config": (
        "tiny_llama_dir",
        SCHEMES["gptq-4bit-act-order"],
        "quantize_config.json",
        AUTOGPTQ_FILE,
    ),
    "qwen2-autoawq-quant-config": (
        "tiny_qwen2_dir",
        SCHEMES["awq-4bit-g32"],
        "quant_config.json",
        AUTOAWQ_FILE,
    ),
    # some AutoAWQ exports named the file as AutoGPTQ did: the keys say it is AWQ
    "llama-autoawq-quantize-config": (
        "tiny_llama_dir",
        SCHEMES["awq-4bit-g32"],
        "quantize_config.json",
        AUTOAWQ_FILE,
    ),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_checkpoint_with_only_a_quantization_file_runs_as_its_twin(
    request: pytest.FixtureRequest, tmp_path: Path, case: str
) -> None:
    fixture, scheme, file_name, stated = FILE_CASES[case]
    quantized, twin, _ = write_int_twins(request.getfixturevalue(fixture), tmp_path, scheme)
    _move_config_to_file(quantized, file_name, stated)
    assert "quantization_config" not in json.loads((quantized / "config.json").read_text())
    assert load_hf_config(quantized).quantization_config["quant_method"] == scheme.method
    _, expected, got = greedy_on_twin_and_checkpoint(twin, quantized)
    assert got == expected


def test_awq_spellings_in_config_json_dequantize_as_the_usual_ones() -> None:
    generator = torch.Generator().manual_seed(3)
    parts, expected = _packed_module(
        torch.randn(48, 64, generator=generator), Scheme("awq"), generator
    )
    spelled = {"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "zero_point": True}
    check_quantization(_hf_config(spelled))
    out = dict(dequantized_weights([(f"m.{k}", v) for k, v in parts.items()], _hf_config(spelled)))
    assert torch.equal(out["m.weight"], expected)


def test_config_json_comes_first_and_an_agreeing_file_is_fine(tmp_path: Path) -> None:
    stated = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    (tmp_path / "quantize_config.json").write_text(
        json.dumps({"bits": 4, "group_size": 128, "sym": True})
    )
    assert checkpoint_int_config(tmp_path, stated) == stated
    assert checkpoint_int_config(tmp_path / "absent", None) is None


CONTRADICTIONS = {
    # file name -> its contents; config.json's quantization_config or None
    "w_bit vs bits in one file": (
        {"quant_config.json": {"w_bit": 4, "bits": 8, "q_group_size": 128}},
        None,
        r"quant_config.json states bits=8 and w_bit=4",
    ),
    "config.json vs quantize_config.json": (
        {"quantize_config.json": {"bits": 4, "group_size": 64, "desc_act": False}},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        r"group_size=128 but quantize_config.json says 64",
    ),
    "the two files": (
        {
            "quantize_config.json": {"quant_method": "gptq", "bits": 4, "group_size": 128},
            "quant_config.json": {"w_bit": 4, "q_group_size": 128, "zero_point": True},
        },
        None,
        r"quant_method='gptq' but quant_config.json says 'awq'",
    ),
    "AWQ and GPTQ keys in one file": (
        {
            "quantize_config.json": {
                "bits": 4,
                "group_size": 128,
                "desc_act": True,
                "version": "gemm",
            }
        },
        None,
        r"both AWQ keys \(version\) and GPTQ keys \(desc_act\)",
    ),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_contradicting_configs_are_refused_by_name(tmp_path: Path, case: str) -> None:
    files, in_config_json, message = CONTRADICTIONS[case]
    for name, contents in files.items():
        (tmp_path / name).write_text(json.dumps(contents))
    with pytest.raises(ValueError, match=message):
        checkpoint_int_config(tmp_path, in_config_json)


def test_autoawq_spellings_say_awq_in_either_file_name(tmp_path: Path) -> None:
    """A quantization file holding only AutoAWQ's ``w_bit`` and ``q_group_size`` is AWQ,
    whichever of the two names it has (they are read as ``bits``/``group_size`` after the
    method is inferred)."""
    (tmp_path / "quantize_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 128}))
    found = checkpoint_int_config(tmp_path, None)
    assert found == {"quant_method": "awq", "bits": 4, "group_size": 128}


def test_gptqmodels_format_key_is_the_checkpoint_format() -> None:
    """GPTQModel versions that wrote ``format`` for ``checkpoint_format``: a ``gptq_v2``
    stated that way stores zero points as they are (not minus one), and formats not read
    or two keys that disagree are refused, never read as v1."""
    base = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    assert packed_int_format({**base, "format": "gptq_v2"}).zero_offset == 0
    assert packed_int_format({**base, "format": "gptq"}).zero_offset == 1
    with pytest.raises(ValueError, match="'marlin' is not supported"):
        packed_int_format({**base, "format": "marlin"})
    with pytest.raises(ValueError, match="checkpoint_format='gptq' and format='gptq_v2'"):
        packed_int_format({**base, "checkpoint_format": "gptq", "format": "gptq_v2"})


def test_bits_spelled_twice_in_config_json_is_refused() -> None:
    quant = {"quant_method": "awq", "bits": 4, "w_bit": 8, "group_size": 128}
    with pytest.raises(ValueError, match="bits=4 and w_bit=8"):
        check_quantization(_hf_config(quant))


def test_a_contradicting_file_is_refused_before_loading(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    copy_stating(tiny_llama_dir, model_dir, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    (model_dir / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 32}))
    with pytest.raises(ValueError, match=r"bits=4 but quantize_config\.json says 8"):
        LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)


def _act_order_parts() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(16, 64, generator=generator)
    return _packed_module(weight, SCHEMES["gptq-4bit-act-order"], generator)


def test_a_reordering_g_idx_is_honoured_without_desc_act(caplog: pytest.LogCaptureFixture) -> None:
    """AutoGPTQ's and GPTQModel's dequantization read g_idx whatever desc_act says."""
    parts, expected = _act_order_parts()
    plain = _hf_config(Scheme("gptq").config())  # desc_act: false
    ordered = sorted((f"m.{k}", v) for k, v in parts.items())  # as safetensors lists them
    with caplog.at_level("WARNING"):
        out = dict(dequantized_weights(ordered, plain))
    assert torch.equal(out["m.weight"], expected)
    assert "m.g_idx reorders the input rows although desc_act is false" in caplog.text
    # a consecutive g_idx, or none, reads as the usual groups
    consecutive = dict(parts, g_idx=torch.arange(64, dtype=torch.int32) // 32)
    with_idx = dict(
        dequantized_weights(sorted((f"m.{k}", v) for k, v in consecutive.items()), plain)
    )
    without = dict(
        dequantized_weights([(f"m.{k}", v) for k, v in consecutive.items() if k != "g_idx"], plain)
    )
    assert torch.equal(with_idx["m.weight"], without["m.weight"])


def test_a_reordering_g_idx_after_its_module_is_refused() -> None:
    parts, _ = _act_order_parts()
    plain = _hf_config(Scheme("gptq").config())
    late = [(f"m.{k}", v) for k, v in parts.items() if k != "g_idx"] + [("m.g_idx", parts["g_idx"])]
    with pytest.raises(ValueError, match=r"m\.g_idx reorders the input rows .* comes after"):
        list(dequantized_weights(late, plain))
