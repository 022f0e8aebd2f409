"""Packed AWQ/GPTQ checkpoints of models whose projections are not Llama's separate
``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``: Phi-3 (fused ``qkv_proj`` and
``gate_up_proj`` in the checkpoint) and Mixtral (experts' ``w1``/``w3``/``w2``), with the zero
biases older GPTQ tools add to every layer. Where a bias would go is the model plugin's
``merged_projections``; a model that declares none is refused, not guessed at.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from test_fp8_checkpoints import greedy_on_twin_and_checkpoint
from test_int4_checkpoints import SCHEMES, Scheme, write_int_twins

from chassis.builtin_plugins.models.mixtral import MixtralForCausalLM
from chassis.builtin_plugins.models.phi3 import Phi3ForCausalLM
from chassis.core.packed_int_weights import without_phantom_biases

#: a decoder layer's projection or expert weight (Mixtral's w1/w2/w3 included)
_PACKED = re.compile(r".*\.layers\.\d+\..*(_proj|\.w[123])\.weight$")


def _packs_projections_and_experts(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and _PACKED.match(name) is not None


@pytest.fixture(scope="module")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Phi3Config

    config = Phi3Config(**TINY_CONFIG_FIELDS, tie_word_embeddings=False)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("tiny_phi3"))


CASES = {
    # the checkpoint's qkv_proj/gate_up_proj are packed whole; their zero biases go nowhere
    "phi3-gptq": ("tiny_phi3_dir", SCHEMES["gptq-4bit-act-order"], "self_attn.qkv_proj.bias"),
    "phi3-awq": ("tiny_phi3_dir", SCHEMES["awq-4bit-g32"], "mlp.gate_up_proj.bias"),
    # experts named w1/w3/w2 (stacked into w13/w2 by the model), router left unpacked
    "mixtral-gptq": ("tiny_mixtral_dir", Scheme("gptq", sym=True), "experts.1.w3.bias"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_checkpoint_with_other_projection_names_runs_as_its_twin(
    request: pytest.FixtureRequest, tmp_path: Path, case: str
) -> None:
    fixture, scheme, phantom = CASES[case]
    quantized, twin, packed = write_int_twins(
        request.getfixturevalue(fixture),
        tmp_path,
        scheme,
        phantom_biases=True,
        is_quantized=_packs_projections_and_experts,
    )
    assert any(name.endswith(phantom) for name in packed)
    assert any(name.endswith(phantom.replace(".bias", ".qweight")) for name in packed)
    _, expected, got = greedy_on_twin_and_checkpoint(twin, quantized)
    assert got == expected


def test_the_built_in_models_declare_their_merged_projections() -> None:
    assert Phi3ForCausalLM.merged_projections["q_proj"] == "qkv_proj"
    assert MixtralForCausalLM.merged_projections["up_proj"] == "gate_up_proj"


def test_a_model_without_merged_projections_is_refused_a_zero_bias_it_cannot_place() -> None:
    weights = [("layers.0.attn.query.bias", torch.zeros(4))]
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.query\.bias'.*merged_projections"):
        list(without_phantom_biases(weights, {"layers.0.attn.qkv.weight"}, None))
    # a bias of the model's own name needs no mapping
    own = [("layers.0.attn.o.bias", torch.zeros(4))]
    assert list(without_phantom_biases(own, {"layers.0.attn.o.bias"}, None)) == own


def test_a_models_own_projection_names_place_the_biases() -> None:
    """A model merging ``query``/``key``/``value`` into ``qkv`` (with a bias) and ``w1``/``w3``
    into ``w13`` (without): the zero query bias loads, the zero w1 bias is left out."""
    merged = {"query": "qkv", "key": "qkv", "value": "qkv", "w1": "w13", "w3": "w13"}
    params = {"l.attn.qkv.weight", "l.attn.qkv.bias", "l.mlp.w13.weight"}
    weights = [
        ("l.attn.query.bias", torch.zeros(4)),
        ("l.mlp.w1.bias", torch.zeros(4)),
        ("l.attn.dense.bias", torch.zeros(4)),  # not merged, no such parameter
    ]
    kept = [name for name, _ in without_phantom_biases(weights, params, merged)]
    assert kept == ["l.attn.query.bias"]
