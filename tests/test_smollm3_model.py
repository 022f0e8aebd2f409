"""SmolLM3 against HF transformers on a tiny random float32 checkpoint.

The checkpoint has 4 layers of hidden 64 (4 heads, 2 KV heads of 16) that cover every
combination of SmolLM3's two per-layer options: layer 0 RoPE and a 6-token window, layer 1
no RoPE and the window, layer 2 RoPE and full attention, layer 3 no RoPE and full attention.
Attention and MLP biases are on and norm weights randomized around 1, the LM head tied.
Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix, and decodes
past the window); greedy tokens through ``LLM`` must be HF's ``generate``'s for prompts
longer than a KV block, with and without chunked prefill, and on two tensor-parallel ranks.
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
from test_models_parity import check_parity, hf_logits, load_hf
from test_sliding_window_models import check_window_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.smollm3 import (
    SmolLM3Attention,
    SmolLM3ForCausalLM,
    rope_layers,
    smollm3_sliding_layers,
)
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 6
#: layer -> (applies RoPE, slides): all four combinations
LAYERS = [(True, True), (False, True), (True, False), (False, False)]


def tiny_config(**overrides: Any) -> Any:
    from transformers import SmolLM3Config

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "num_hidden_layers": len(LAYERS),
        "no_rope_layers": [int(rope) for rope, _ in LAYERS],
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "layer_types": [
            "sliding_attention" if slides else "full_attention" for _, slides in LAYERS
        ],
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    }
    return SmolLM3Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_smollm3"), seed=3)


def build(config: Any) -> SmolLM3ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return SmolLM3ForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Two prompts (13 and 3 tokens) prefilled together, a decode each, then a 2-token chunk
    each over the cached prefix (blocks of 4); then chunked prefills and decodes to 24 tokens,
    four times the window: every row's float32 logits equal HF's."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)
    runner = check_window_parity(model_dir)
    layers = runner.model.model.layers
    assert [layer.self_attn.use_rope for layer in layers] == [rope for rope, _ in LAYERS]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [
        WINDOW if slides else None for _, slides in LAYERS
    ]


def test_each_layer_option_changes_the_logits(model_dir: Path) -> None:
    """The parity test can fail: HF's own logits move when the NoPE layers rotate after all,
    and when the sliding layers see everything."""
    hf_model = load_hf(model_dir)
    tokens = list(range(100, 120))
    reference = hf_logits(hf_model, tokens)
    for layer in hf_model.model.layers:
        layer.self_attn.use_rope = True
    with_rope = hf_logits(hf_model, tokens)
    assert (with_rope - reference).abs().max() > 1e-2
    hf_model = load_hf(model_dir)
    hf_model.config.layer_types = ["full_attention"] * len(LAYERS)
    for layer in hf_model.model.layers:
        layer.self_attn.sliding_window = None
    full = hf_logits(hf_model, tokens)
    torch.testing.assert_close(full[:WINDOW], reference[:WINDOW], atol=1e-5, rtol=1e-5)
    assert (full[-1] - reference[-1]).abs().max() > 1e-2


# -- what the config says ---------------------------------------------------------------------


def test_defaults_derive_the_layers_as_transformers_does() -> None:
    """A config without ``no_rope_layers`` and ``layer_types`` (an older config.json, or one
    written by hand): the same layers as HF's derived lists. With the window on, the NoPE
    layers slide; without it, none does."""
    from transformers import SmolLM3Config

    for interval, use_window in [(4, True), (3, True), (4, False)]:
        sizes = {"num_hidden_layers": 8, "no_rope_layer_interval": interval}
        window = {"use_sliding_window": use_window, "sliding_window": 16}
        hf_config = SmolLM3Config(**sizes, **window)
        bare = SimpleNamespace(**sizes, **window)
        assert rope_layers(bare) == tuple(bool(flag) for flag in hf_config.no_rope_layers)
        expected = {i for i, kind in enumerate(hf_config.layer_types) if kind != "full_attention"}
        assert smollm3_sliding_layers(bare) == smollm3_sliding_layers(hf_config) == expected
        assert len(expected) == (8 // interval if use_window else 0)
    # HF's own default interval, 4: layers 3 and 7 leave RoPE out
    assert rope_layers(SimpleNamespace(num_hidden_layers=8)) == (True,) * 3 + (False,) + (
        True,
    ) * 3 + (False,)


def test_the_default_rope_base_is_smollm3s() -> None:
    """A config that names no RoPE base gets SmolLM3's 2,000,000 (HF's default for it)."""
    model = build(tiny_config(rope_parameters=None))
    layer = model.model.layers[0].self_attn
    theta = 2_000_000.0
    expected = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(layer.rotary_emb.cos_cache[1], expected.cos())


def test_unsupported_options_are_refused() -> None:
    config = tiny_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build(config)
    config = tiny_config(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build(config)
    config = tiny_config()
    config.no_rope_layers = [1, 0, 1]
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries for 4 layers"):
        build(config)
    config.no_rope_layers = [1, 0, 2, 1]
    with pytest.raises(ValueError, match=r"no_rope_layers entries must be 1 \(RoPE\) or 0"):
        build(config)
    config = tiny_config()
    config.layer_types = ["chunked_attention", *config.layer_types[1:]]
    with pytest.raises(ValueError, match="layer_types has 'chunked_attention'"):
        build(config)
    # sliding layers where HF's attention reads no window (but its mask has one)
    config = tiny_config()
    config.use_sliding_window = False
    with pytest.raises(ValueError, match="marks sliding_attention layers, but use_sliding"):
        build(config)


def test_models_build_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = SmolLM3ForCausalLM(tiny_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert isinstance(model.model.layers[1].self_attn, SmolLM3Attention)


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
    """Two real ranks (half the heads, one KV head and half the MLP columns each), the NoPE
    and windowed layers included: HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
