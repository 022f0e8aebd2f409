"""AWQ and GPTQ checkpoints load dequantized: the weights are exactly ``(q - z) * s`` and the
engine's tokens and logprobs equal HF's on the dequantized twin of the checkpoint.

The test packs its own checkpoints: random float weights quantized to ``bits``-bit codes
per group (asymmetric or symmetric, optionally in act-order with a ``g_idx``) and packed
into int32s one code at a time by shifts, independently of the code under test.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixtures_lora import hf_greedy
from safetensors.torch import load_file, save_file
from test_fp8_checkpoints import NEW_TOKENS, PROMPTS, _is_quantized, copy_stating

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.models.llama import LlamaForCausalLM
from chassis.core import packed_int_weights
from chassis.core.packed_int_weights import without_phantom_biases
from chassis.core.quantized_weights import check_quantization, dequantized_weights

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output column held by each nibble of an AWQ int32


@dataclass(frozen=True)
class Scheme:
    """One checkpoint layout to write."""

    method: str  # "gptq" or "awq"
    bits: int = 4
    group_size: int = 32
    sym: bool = False
    act_order: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (zero points stored minus one) or "gptq_v2"

    def config(self) -> dict[str, object]:
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "version": "gemm",
                "zero_point": True,
                "modules_to_not_convert": None,
            }
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.act_order,
            "sym": self.sym,
            "checkpoint_format": self.checkpoint_format,
            "true_sequential": True,
        }


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def _quantize(weight: torch.Tensor, scheme: Scheme, generator: torch.Generator):
    """Codes ``q`` ``[out, in]``, zero points and fp16 scales ``[groups, out]`` and the group
    of each input row, for ``weight`` ``[out, in]``."""
    out_features, in_features = weight.shape
    size = in_features if scheme.group_size == -1 else scheme.group_size
    groups = in_features // size
    if scheme.act_order:  # rows taken in a random order, grouped in that order
        order = torch.randperm(in_features, generator=generator)
        g_idx = torch.empty(in_features, dtype=torch.int64)
        g_idx[order] = torch.arange(in_features) // size
    else:
        g_idx = torch.arange(in_features) // size
    top = 2**scheme.bits - 1
    scales = torch.empty(groups, out_features)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        rows = weight[:, g_idx == g]
        if scheme.sym:
            scales[g] = rows.abs().amax(1) / (2 ** (scheme.bits - 1) - 1)
            zeros[g] = 2 ** (scheme.bits - 1)
        else:
            low, high = rows.amin(1), rows.amax(1)
            scales[g] = (high - low) / top
            # GPTQ's v1 format cannot store a zero point of 0 (it stores z - 1)
            zeros[g] = (-low / scales[g]).round().clamp(1, top).long()
    scales = scales.half()
    codes = (weight / scales.float()[g_idx].t()).round().long() + zeros[g_idx].t()
    return codes.clamp(0, top), zeros, scales, g_idx


def _pack(codes: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """``codes`` ``[rows, cols]`` packed along the columns: word ``c`` of a row holds columns
    ``c * n .. c * n + n - 1`` (``n = 32 / bits``), slot ``i`` (bits ``i * bits`` up) holding
    column ``c * n + order[i]``."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    words = torch.zeros(codes.shape[0], codes.shape[1] // per_word, dtype=torch.int64)
    for c in range(words.shape[1]):
        for slot, column in enumerate(order):
            words[:, c] |= codes[:, c * per_word + column] << (slot * bits)
    return _as_int32(words)


def _packed_module(weight: torch.Tensor, scheme: Scheme, generator: torch.Generator):
    """The checkpoint tensors of one quantized module and its dequantized float32 weight."""
    codes, zeros, scales, g_idx = _quantize(weight, scheme, generator)
    dequantized = (codes - zeros[g_idx].t()).float() * scales.float()[g_idx].t()
    if scheme.method == "awq":
        parts = {
            "qweight": _pack(codes.t(), scheme.bits, AWQ_ORDER),
            "qzeros": _pack(zeros, scheme.bits, AWQ_ORDER),
            "scales": scales,
        }
    else:
        stored = zeros - 1 if scheme.checkpoint_format == "gptq" else zeros
        parts = {
            "qweight": _pack(codes, scheme.bits).t().contiguous(),  # packed along the input
            "qzeros": _pack(stored, scheme.bits),
            "scales": scales,
            "g_idx": g_idx.to(torch.int32),
        }
    return parts, dequantized


def write_int_twins(
    source: Path,
    root: Path,
    scheme: Scheme,
    phantom_biases: bool = False,
    is_quantized: Callable[[str, torch.Tensor], bool] = _is_quantized,
) -> tuple[Path, Path, dict]:
    """A packed copy of ``source`` in ``scheme``, its dequantized float32 twin, and the
    packed tensors. ``phantom_biases`` gives each packed layer without a bias a zero one, as
    older GPTQ tools did; ``is_quantized(name, tensor)`` picks the layers packed (default:
    the decoder's ``*_proj`` weights)."""
    quantized, twin = root / "packed", root / "twin"
    for directory in (quantized, twin):
        shutil.copytree(source, directory)
    generator = torch.Generator().manual_seed(0)
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    tensors = load_file(str(source / "model.safetensors"))
    for name, tensor in tensors.items():
        if not is_quantized(name, tensor):
            packed[name] = dequantized[name] = tensor
            continue
        parts, dequantized[name] = _packed_module(tensor.float(), scheme, generator)
        base = name.removesuffix(".weight")
        packed.update({f"{base}.{part}": value for part, value in parts.items()})
        if phantom_biases and f"{base}.bias" not in tensors:
            packed[f"{base}.bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(dequantized, str(twin / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = scheme.config()
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin, packed


def _hf_config(quant: dict[str, object]) -> object:
    return type("Config", (), {"quantization_config": quant})()


SCHEMES = {
    "gptq-4bit-g32": Scheme("gptq"),
    "gptq-4bit-sym": Scheme("gptq", sym=True),
    "gptq-4bit-act-order": Scheme("gptq", act_order=True),
    "gptq-4bit-one-group": Scheme("gptq", group_size=-1, act_order=True, sym=True),
    "gptq-4bit-v2": Scheme("gptq", checkpoint_format="gptq_v2"),
    "gptq-8bit": Scheme("gptq", bits=8),
    "gptq-2bit-act-order": Scheme("gptq", bits=2, act_order=True),
    "awq-4bit-g32": Scheme("awq"),
    "awq-4bit-one-group": Scheme("awq", group_size=-1),
}


@pytest.mark.parametrize("rows_per_step", [packed_int_weights.ROWS_PER_STEP, 16])
@pytest.mark.parametrize("key", list(SCHEMES))
def test_weights_dequantize_to_q_minus_z_times_s(
    key: str, rows_per_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 rows at a time: the 64 input rows take several steps
    monkeypatch.setattr(packed_int_weights, "ROWS_PER_STEP", rows_per_step)
    scheme = SCHEMES[key]
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=generator)
    parts, expected = _packed_module(weight, scheme, generator)
    # the parts may come in any order, around tensors that pass through
    tensors = [("m.bias", torch.ones(48))]
    tensors += [(f"m.{part}", value) for part, value in reversed(parts.items())]
    tensors += [("lm_head.weight", torch.ones(3, 3))]
    out = dict(dequantized_weights(tensors, _hf_config(scheme.config())))
    assert sorted(out) == ["lm_head.weight", "m.bias", "m.weight"]
    assert out["m.weight"].dtype == torch.float32
    assert torch.equal(out["m.weight"], expected)
    # the quantization is real: the codes differ from the float weight, within a step
    assert not torch.equal(expected, weight)


def test_gptq_v1_zero_points_are_stored_minus_one() -> None:
    """A v1 word of 0x77777777 (sym 4-bit) means zero point 8: codes of 8 dequantize to 0."""
    parts = {
        "qweight": torch.full((1, 8), 0x88888888 - 2**32, dtype=torch.int32),
        "qzeros": torch.full((1, 1), 0x77777777, dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    quant = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}
    out = dict(dequantized_weights([(f"m.{k}", v) for k, v in parts.items()], _hf_config(quant)))
    assert torch.equal(out["m.weight"], torch.zeros(8, 8))
    quant["checkpoint_format"] = "gptq_v2"  # the same words: zero point 7
    out = dict(dequantized_weights([(f"m.{k}", v) for k, v in parts.items()], _hf_config(quant)))
    assert torch.equal(out["m.weight"], torch.ones(8, 8))


TWIN_CASES = {
    "llama-gptq-4bit-act-order": ("tiny_llama_dir", SCHEMES["gptq-4bit-act-order"], False),
    "llama-gptq-8bit": ("tiny_llama_dir", SCHEMES["gptq-8bit"], False),
    "llama-awq": ("tiny_llama_dir", SCHEMES["awq-4bit-g32"], False),
    # zero biases on bias-free layers (Llama's all, Qwen2's o_proj and MLP) are left out;
    # Qwen2's own q/k/v biases load
    "llama-gptq-phantom-biases": ("tiny_llama_dir", SCHEMES["gptq-4bit-sym"], True),
    "qwen2-gptq-phantom-biases": ("tiny_qwen2_dir", SCHEMES["gptq-4bit-act-order"], True),
    # experts, shared expert (48 input rows: groups of 16) and an unquantized router
    "qwen2-moe-awq": ("tiny_qwen2_moe_dir", Scheme("awq", group_size=16), False),
}


@pytest.mark.parametrize("case", list(TWIN_CASES))
def test_int_checkpoint_runs_as_its_dequantized_twin(
    request: pytest.FixtureRequest, tmp_path: Path, case: str
) -> None:
    fixture, scheme, phantom_biases = TWIN_CASES[case]
    source = request.getfixturevalue(fixture)
    quantized, twin, packed = write_int_twins(source, tmp_path, scheme, phantom_biases)
    if phantom_biases:
        assert any(name.endswith("mlp.down_proj.bias") for name in packed)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(str(quantized), dtype="float32", max_model_len=64, num_kv_blocks=16)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    outputs = llm.generate(PROMPTS, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        assert out.prompt_logprobs is not None
        for position in range(1, len(prompt)):
            token = prompt[position]
            got = out.prompt_logprobs[position][token].logprob
            assert got == pytest.approx(float(logprobs[position - 1, token]), abs=1e-4)
    # the twin is not the original: quantization changed the weights
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(reference.parameters(), original.parameters(), strict=True)
    )


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_act_order_gptq_under_tensor_parallelism(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two ranks shard the dequantized weights as they would the unquantized ones."""
    quantized, twin, _ = write_int_twins(tiny_llama_dir, tmp_path, SCHEMES["gptq-4bit-act-order"])
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(
        str(quantized), dtype="float32", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    del llm
    gc.collect()
    assert got == expected


REFUSED = [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
        "'marlin'",
    ),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "Marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4}, "group_size"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "'exllama'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "8-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"}, "'llm-awq'"),
    ({"quant_method": "awq", "bits": 4}, "group_size"),
]


@pytest.mark.parametrize(("quant", "message"), REFUSED)
def test_unsupported_int_configs_are_refused_by_name(quant: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_quantization(_hf_config(quant))


def test_an_unsupported_int_config_is_refused_before_loading(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "gptq3"
    copy_stating(tiny_llama_dir, model_dir, {"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(ValueError, match="3-bit"):
        LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_only_zero_biases_the_model_has_no_place_for_are_left_out() -> None:
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    params = [f"{attn}.qkv_proj.weight", f"{attn}.qkv_proj.bias", f"{attn}.o_proj.weight"]
    params += [f"{mlp}.down_proj.weight", f"{mlp}.down_proj.bias", f"{mlp}.gate_up_proj.weight"]
    zero, one = torch.zeros(4), torch.ones(4)
    weights = [
        (f"{attn}.q_proj.bias", zero),  # loads into qkv_proj.bias
        (f"{attn}.o_proj.bias", zero),  # left out
        (f"{mlp}.down_proj.bias", zero),  # the model has it
        (f"{mlp}.gate_proj.bias", zero),  # left out
        (f"{mlp}.up_proj.bias", one),  # not zero: passes (and the model refuses it)
        (f"{mlp}.down_proj.qweight", torch.zeros(1, 8, dtype=torch.int32)),
    ]
    merged = LlamaForCausalLM.merged_projections
    kept = [name for name, _ in without_phantom_biases(weights, params, merged)]
    assert kept == [
        f"{attn}.q_proj.bias",
        f"{mlp}.down_proj.bias",
        f"{mlp}.up_proj.bias",
        f"{mlp}.down_proj.qweight",
    ]


def test_packed_tensors_that_do_not_fit_are_refused() -> None:
    scheme = SCHEMES["gptq-4bit-act-order"]
    generator = torch.Generator().manual_seed(2)
    parts, _ = _packed_module(torch.randn(16, 64, generator=generator), scheme, generator)
    config = _hf_config(scheme.config())
    missing = [(f"m.{k}", v) for k, v in parts.items() if k != "g_idx"]
    with pytest.raises(ValueError, match=r"m \(no g_idx\)"):
        list(dequantized_weights(missing, config))
    wrong = dict(parts, scales=parts["scales"][:1])
    with pytest.raises(ValueError, match="m: scales has shape"):
        list(dequantized_weights([(f"m.{k}", v) for k, v in wrong.items()], config))
    bad_groups = dict(parts, g_idx=parts["g_idx"] + 5)
    with pytest.raises(ValueError, match="g_idx names groups"):
        list(dequantized_weights([(f"m.{k}", v) for k, v in bad_groups.items()], config))
    # without desc_act a g_idx coming after its module's other tensors must be consecutive
    plain = _hf_config(Scheme("gptq").config())
    with pytest.raises(ValueError, match="desc_act is false"):
        list(dequantized_weights([(f"m.{k}", v) for k, v in parts.items()], plain))
