"""OLMo 3 against HF transformers on tiny random float32 checkpoints.

The checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16: layer 0 slides over a
window of 6 positions, layer 1 attends to everything. Its RoPE differs per layer type (YaRN
with factor 4 on the full layer, plain RoPE of another base on the sliding one), it has
attention biases, and its biases and norm weights are randomized (norms around 1), so a
misplaced norm or bias, the wrong window or the wrong RoPE table changes the logits. Logits
must match HF's (batched prefill, a decode, a chunk over a cached prefix; and past the
window); greedy tokens through ``LLM`` must be HF's ``generate``'s for prompts longer than a
KV block, with and without chunked prefill, and on two tensor-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import check_parity
from test_sliding_window_models import check_window_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.olmo2 import ProjectionRMSNorm
from chassis.builtin_plugins.models.olmo3 import (
    Olmo3ForCausalLM,
    olmo3_layer_types,
    olmo3_rope_by_layer_type,
)
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention"]
#: YaRN on the full layers (as OLMo 3's long-context checkpoints), another base on the sliding
ROPE = {
    "full_attention": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
}


def tiny_config(**overrides: Any) -> Any:
    from transformers import Olmo3Config

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "sliding_window": WINDOW,
        "layer_types": LAYER_TYPES,
        "rope_parameters": {kind: dict(params) for kind, params in ROPE.items()},
    }
    return Olmo3Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_olmo3"), seed=3)


def build(config: Any) -> Olmo3ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return Olmo3ForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Two prompts (13 tokens: past the window) prefilled together, a decode each, then a
    2-token chunk each over the cached prefix: every row's float32 logits equal HF's."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_logits_past_the_window_match_transformers(model_dir: Path) -> None:
    """A prefill in two chunks and decodes to 24 tokens, four times the window."""
    runner = check_window_parity(model_dir)
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None]


def test_the_config_is_read() -> None:
    model = build(tiny_config())
    sliding, full = (layer.self_attn for layer in model.model.layers)
    # OLMo 2's norms: one over all q heads, one over both KV heads; post-norms only
    assert isinstance(sliding.q_norm, ProjectionRMSNorm)
    assert (sliding.q_norm.weight.shape, sliding.k_norm.weight.shape) == ((64,), (32,))
    assert not hasattr(model.model.layers[0], "input_layernorm")
    assert sliding.qkv_proj.bias is not None and sliding.o_proj.bias is not None
    assert model.model.layers[0].mlp.gate_up_proj.bias is None
    # one RoPE table per layer type: YaRN's scaled cos on the full layer only
    assert sliding.rotary_emb is not full.rotary_emb
    assert not torch.allclose(sliding.rotary_emb.cos_cache, full.rotary_emb.cos_cache)
    assert full.rotary_emb.cos_cache[0, 0] > 1.0  # YaRN's attention factor
    assert sliding.rotary_emb.cos_cache[0, 0] == 1.0


def test_layer_types_and_rope_follow_hf_config_rules() -> None:
    """Without ``layer_types`` every fourth layer is full, as HF's config derives it; a
    legacy ``rope_theta`` and ``rope_scaling`` go to the full layers only (HF's conversion:
    the sliding layers keep its default base), and a flat set is read as HF converts it."""
    from transformers import Olmo3Config

    hf = Olmo3Config(**{**TINY_CONFIG_FIELDS, "num_hidden_layers": 8})
    ours = SimpleNamespace(num_hidden_layers=8)
    assert olmo3_layer_types(ours) == tuple(hf.layer_types)
    assert olmo3_layer_types(ours).count("full_attention") == 2

    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
    hf = Olmo3Config(**TINY_CONFIG_FIELDS, rope_theta=5000.0, rope_scaling=dict(yarn))
    from_hf = olmo3_rope_by_layer_type(hf)
    flat = SimpleNamespace(rope_theta=5000.0, rope_scaling=dict(yarn), max_position_embeddings=512)
    from_flat = olmo3_rope_by_layer_type(flat)
    for rope in (from_hf, from_flat):
        assert rope["full_attention"]["rope_type"] == "yarn"
        assert rope["full_attention"]["factor"] == 8.0
        assert rope["full_attention"]["rope_theta"] == 5000.0
        assert rope["sliding_attention"]["rope_type"] == "default"
        assert rope["sliding_attention"]["rope_theta"] == 500_000.0


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build(tiny_config(hidden_act="gelu"))
    rope = {**ROPE, "full_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build(tiny_config(rope_parameters=rope))
    config = tiny_config()
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types has unsupported entries \['chunked"):
        build(config)
    config.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        build(config)


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Olmo3ForCausalLM(tiny_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """All prompts in one ``generate``, on the CPU's default backend and block size, then
    with prefills chunked to at most 16 tokens over blocks of 4."""
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads and MLP columns each, the projection norms' mean square
    summed over both, the window and the RoPE tables per layer as on one."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
