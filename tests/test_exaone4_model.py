"""EXAONE 4.0 against HF transformers on tiny random float32 checkpoints.

The hybrid checkpoint (EXAONE-4.0-32B's layout) has 2 layers of hidden 64, 4 heads and 2 KV
heads of ``head_dim`` 32 (not hidden / heads): layer 0 slides over a window of 6 positions
with RoPE (Llama-3 scaling), layer 1 attends to everything with no RoPE at all. Its norm
weights (the per-head q/k norms and the post-norms) are randomized around 1, so a misplaced
norm, a rotated global layer or the wrong window changes the logits. The other checkpoint
(EXAONE-4.0-1.2B's layout) has no window: every layer is full attention with RoPE, and the
embeddings are tied. Logits must match HF's (batched prefill, a decode, a chunk over a
cached prefix; and past the window); greedy tokens through ``LLM`` must be HF's
``generate``'s for prompts longer than a KV block, with and without chunked prefill, and on
two tensor-parallel ranks.
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
from chassis.builtin_plugins.models.exaone4 import (
    Exaone4ForCausalLM,
    NoRotaryEmbedding,
    exaone4_layer_types,
)
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 6
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def tiny_config(hybrid: bool = True, **overrides: Any) -> Any:
    from transformers import Exaone4Config

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "head_dim": 32,
        "rope_parameters": dict(LLAMA3_ROPE),
    }
    if hybrid:
        fields.update(
            tie_word_embeddings=False,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    else:
        fields.update(
            tie_word_embeddings=True,
            sliding_window=None,
            layer_types=["full_attention", "full_attention"],
        )
    return Exaone4Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_exaone4"), seed=3)


def build(config: Any) -> Exaone4ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return Exaone4ForCausalLM(config, ctx)


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


def test_logits_without_a_window_match_transformers(tmp_path: Path) -> None:
    """The 1.2B layout: no window, every layer full attention with RoPE, tied embeddings."""
    model_dir = save_tiny_checkpoint(tiny_config(hybrid=False), tmp_path, seed=5)
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_the_config_is_read() -> None:
    model = build(tiny_config())
    sliding, full = (layer.self_attn for layer in model.model.layers)
    # RoPE on the sliding layer only
    assert isinstance(sliding.rotary_emb, RotaryEmbedding)
    assert isinstance(full.rotary_emb, NoRotaryEmbedding)
    # per-head q/k norms, post-norms only, no biases
    assert (sliding.q_norm.weight.shape, sliding.k_norm.weight.shape) == ((32,), (32,))
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm")
    assert hasattr(layer, "post_feedforward_layernorm")
    assert sliding.qkv_proj.bias is None and sliding.o_proj.bias is None
    # without a window every layer rotates
    plain = build(tiny_config(hybrid=False))
    assert all(isinstance(la.self_attn.rotary_emb, RotaryEmbedding) for la in plain.model.layers)
    assert [la.self_attn.attn.sliding_window for la in plain.model.layers] == [None, None]
    assert plain.tie_word_embeddings


def test_layer_types_follow_hf_config_rules() -> None:
    """Without ``layer_types``, an integer ``sliding_window_pattern`` derives them as HF's
    config does; a string pattern with nothing to say what it means is refused."""
    from transformers import Exaone4Config

    fields = {**TINY_CONFIG_FIELDS, "num_hidden_layers": 8, "sliding_window": 16}
    for pattern in (2, 4):
        hf = Exaone4Config(**fields, sliding_window_pattern=pattern)
        ours = SimpleNamespace(**fields, sliding_window_pattern=pattern)
        assert exaone4_layer_types(ours) == tuple(hf.layer_types)
        assert exaone4_layer_types(ours).count("full_attention") == 8 // pattern
    ours = SimpleNamespace(**{**fields, "sliding_window": None})
    assert exaone4_layer_types(ours) == ("full_attention",) * 8
    with pytest.raises(ValueError, match="sliding_window_pattern 'LLLG' without layer_types"):
        exaone4_layer_types(SimpleNamespace(**fields, sliding_window_pattern="LLLG"))


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build(tiny_config(hidden_act="gelu"))
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build(tiny_config(rope_parameters=rope))
    config = tiny_config()
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types has unsupported entries \['chunked"):
        build(config)


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Exaone4ForCausalLM(tiny_config(), ctx)
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
    """Two real ranks: half the heads (one KV head each) and MLP columns each, the per-head
    norms whole on both, the window and the global layer's missing RoPE as on one."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
