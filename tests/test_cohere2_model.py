"""Cohere2 (Command R7B) against HF transformers on tiny random float32 checkpoints.

The checkpoint has 3 layers of hidden 64, 4 heads and 2 KV heads of 16: layers 0 and 2 slide
over 6 positions with interleaved RoPE, layer 1 attends to everything with no positional
encoding; ``attention_bias`` on q/k/v/o, LayerNorm weights randomized around 1 (so a norm
loaded into the wrong place, or RMSNorm in place of LayerNorm, changes the logits),
``logit_scale`` 0.25 and the LM head tied to the embedding.

Logits must match HF's (prefill, chunked prefill over a cached prefix, decodes past the
window); greedy tokens through ``LLM`` must be HF's ``generate``'s for a batch of prompts of
which some are longer than two KV blocks, with and without chunked prefill, and on two
tensor-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_sliding_window_models import check_window_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.cohere2 import (
    Cohere2DecoderLayer,
    Cohere2ForCausalLM,
    Cohere2LayerNorm,
    cohere2_layer_types,
)
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]

COHERE2_FIELDS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "layer_types": LAYER_TYPES,
    "sliding_window": WINDOW,
    "attention_bias": True,
    "logit_scale": 0.25,
    "tie_word_embeddings": True,
    "layer_norm_eps": 1e-4,
}


def tiny_config(**overrides: Any) -> Any:
    from transformers import Cohere2Config

    return Cohere2Config(**{**TINY_CONFIG_FIELDS, **COHERE2_FIELDS, **overrides})


def build(config: Any, dtype: torch.dtype = torch.float32) -> Cohere2ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return Cohere2ForCausalLM(config, ctx)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_cohere2"), seed=3)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Two prompts (13 and 3 tokens) prefilled together, a decode each, then a 2-token chunk
    each over the cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_window_logits_match_transformers(model_dir: Path) -> None:
    """Sequences of up to 24 tokens over a window of 6 on layers 0 and 2: a batched prefill,
    a chunk over a cached prefix and decodes past the window equal HF's logits."""
    runner = check_window_parity(model_dir)
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW]
    assert [layer.self_attn.use_rope for layer in layers] == [True, False, True]


def test_each_feature_changes_the_answer(model_dir: Path) -> None:
    """Not vacuous: HF's own logits move when the window is dropped, when the full layer
    gets RoPE too, and when ``logit_scale`` is 1."""
    hf_model = load_hf(model_dir)
    tokens = list(range(100, 120))
    reference = hf_logits(hf_model, tokens)
    hf_model.config.logit_scale = 1.0
    hf_model.logit_scale = 1.0
    assert (hf_logits(hf_model, tokens)[-1] - reference[-1] * 4).abs().max() < 1e-4
    hf_model.logit_scale = 0.25
    hf_model.model.layers[1].self_attn.sliding_window = 10_000  # RoPE, and a window too long
    assert (hf_logits(hf_model, tokens)[-1] - reference[-1]).abs().max() > 1e-2
    hf_model.model.layers[1].self_attn.sliding_window = None
    hf_model.config.sliding_window = 10_000  # the sliding layers still rotate, see everything
    assert (hf_logits(hf_model, tokens)[-1] - reference[-1]).abs().max() > 1e-2


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    assert model.logit_scale == 0.25
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.norm, Cohere2LayerNorm) and model.model.norm.eps == 1e-4
    layer = model.model.layers[0]
    assert isinstance(layer, Cohere2DecoderLayer) and not hasattr(layer, "post_attention_layernorm")
    assert isinstance(layer.input_layernorm, Cohere2LayerNorm)
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
    assert layer.mlp.gate_up_proj.bias is None
    # Cohere2Config's own default pattern: three sliding layers, then a full one
    assert cohere2_layer_types(tiny_config(num_hidden_layers=5, layer_types=None)) == (
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    )


def test_layer_norm_is_hf_cohere2_norm_in_bfloat16() -> None:
    """Mean and variance in float32, the weight applied before the cast, as HF's
    ``Cohere2LayerNorm``: equal bit for bit in bfloat16, also with the fused residual add."""
    from transformers.models.cohere2.modeling_cohere2 import Cohere2LayerNorm as HFNorm

    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 3 + 1
    residual = torch.randn(5, 64, dtype=torch.bfloat16)
    ours = Cohere2LayerNorm(64, 1e-5).to(torch.bfloat16)
    hf = HFNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


def test_interleaved_rope_is_hf_rope_in_bfloat16() -> None:
    """The rotation of a sliding layer equals HF's ``apply_rotary_pos_emb`` with HF's tables,
    bit for bit in bfloat16."""
    from transformers.models.cohere2.modeling_cohere2 import (
        Cohere2RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from chassis.builtin_plugins.models.cohere2 import rotate_cohere

    config = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = build(config)
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert isinstance(rotary, RotaryEmbedding)
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17, 200, 511])
    q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(5, 2, 16, dtype=torch.bfloat16)
    cos, sin = Cohere2RotaryEmbedding(config)(q, positions[None])
    # HF's layout: [batch, heads, T, D] with cos/sin [batch, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(rotate_cohere(rotary, positions, q), hf_q[0].transpose(0, 1))
    assert torch.equal(rotate_cohere(rotary, positions, k), hf_k[0].transpose(0, 1))


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            None,  # supported: the control case
        ),
        ({"sliding_window": None}, "sliding_window"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types",
        ),
    ],
    ids=["gelu", "dynamic-rope", "default-rope", "no-window", "chunked-layers"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str | None) -> None:
    config = tiny_config(**overrides)
    if message is None:
        build(config)
        return
    with pytest.raises(ValueError, match=message):
        build(config)


def test_a_partial_rotary_factor_is_refused() -> None:
    config = tiny_config()
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5"):
        build(config)


def test_the_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    with torch.device("meta"):
        model = build(tiny_config(), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """All prompts in one ``generate`` on the CPU's default backend and block size, then with
    prefills chunked to at most 16 tokens over blocks of 4."""
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads (one KV head each) and half the MLP columns, attention
    and MLP each summed over the group; HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
