"""Qwen3-Next (``Qwen3NextForCausalLM``) against HF transformers on a tiny random float32
checkpoint: Gated DeltaNet layers (2 key heads, 4 value heads of 16, conv window 4) around
a gated full-attention layer (2 query heads of 32, one KV head, RoPE on a quarter of each
head), MoE blocks with a shared expert in layers 0-1 and a dense MLP in layer 2
(``mlp_only_layers``). HF runs its pure-torch fallbacks (no fla / causal_conv1d here).

Logits must match HF's (prefill of two requests packed in one step, decodes, 2-token
chunks, a step mixing a chunk and a decode: :func:`state_space_helpers.check_logits`), also
with the delta rule in chunks of 8 (prompts span several) and with the token-by-token
reference; greedy tokens through ``LLM`` must be HF ``generate``'s, with chunked prefill,
preemption and more requests than state slots.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, make_attention_metadata, save_tiny_checkpoint
from state_space_helpers import (
    StateRunner,
    check_forward_without_state_slots,
    check_greedy_tokens,
    check_logits,
    check_logprobs,
)
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import hf_logits, load_hf

from chassis.builtin_plugins.models.qwen3_next import layer_types_of
from chassis.core.attention import ForwardContext
from chassis.core.layers.gated_delta_rule import (
    delta_rule_chunked,
    delta_rule_chunked_varlen,
    delta_rule_recurrence,
    l2_normalize,
)
from chassis.core.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec


def tiny_config(**overrides: Any) -> Any:
    from transformers import Qwen3NextConfig

    fields = {
        **TINY_CONFIG_FIELDS,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [2],
    }
    return Qwen3NextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("qwen3_next"), seed=5)


def test_logits_match_transformers(model_dir: Path) -> None:
    check_logits(model_dir)


@pytest.mark.parametrize("path", ["chunks-of-8", "reference"])
def test_delta_rule_paths_match_transformers(model_dir: Path, path: str) -> None:
    """A 26-token prompt through the chunked delta rule in chunks of 8 (several chunks, the
    last one padded), or through the token-by-token reference, then a 2-token chunk over the
    carried state: HF's logits."""
    runner = StateRunner(model_dir)
    for module in runner.model.modules():
        if isinstance(module, GatedDeltaNet):
            if path == "reference":
                module.use_reference = True
            else:
                module.spec = dataclasses.replace(module.spec, chunk_size=8)
    hf_model = load_hf(model_dir)
    prompt = TOKEN_PROMPTS[0] * 2
    runner.pool.allocate("0")
    logits = runner.step([prompt], [len(prompt)], ["0"])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    logits = runner.step([[5, 77]], [len(prompt) + 2], ["0"])
    expected = hf_logits(hf_model, [*prompt, 5, 77])[-2:]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_chunked_delta_rule_is_the_recurrence() -> None:
    """Several sequences (one padded short, lengths below, at and across the chunk size)
    from nonzero states: the chunked rule equals the token-by-token reference of each."""
    gen = torch.Generator().manual_seed(0)
    heads, k_dim, v_dim, length = 3, 8, 6, 19
    q = l2_normalize(torch.randn(3, length, heads, k_dim, generator=gen)) * k_dim**-0.5
    k = l2_normalize(torch.randn(3, length, heads, k_dim, generator=gen))
    v = torch.randn(3, length, heads, v_dim, generator=gen)
    g = -2 * torch.rand(3, length, heads, generator=gen)
    beta = torch.rand(3, length, heads, generator=gen)
    # the last sequence is 5 tokens long, padded as the layer pads it
    k[2, 5:], g[2, 5:], beta[2, 5:] = 0.0, 0.0, 0.0
    h0 = torch.randn(3, heads, k_dim, v_dim, generator=gen)
    o, h = delta_rule_chunked(h0, q, k, v, g, beta, chunk_size=8)
    for r, n in enumerate([length, length, 5]):
        o_ref, h_ref = delta_rule_recurrence(
            h0[r], q[r, :n], k[r, :n], v[r, :n], g[r, :n], beta[r, :n]
        )
        torch.testing.assert_close(o[r, :n], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[r], h_ref, atol=1e-5, rtol=1e-5)


def test_the_packed_chunked_delta_rule_is_the_recurrence() -> None:
    """Sequences of 19, 1, 8 and 5 tokens packed one after another from nonzero states (the
    layer's prefill path): each one's outputs and final state are its recurrence's."""
    gen = torch.Generator().manual_seed(1)
    heads, k_dim, v_dim, lengths = 2, 8, 6, (19, 1, 8, 5)
    total = sum(lengths)
    q = l2_normalize(torch.randn(total, heads, k_dim, generator=gen)) * k_dim**-0.5
    k = l2_normalize(torch.randn(total, heads, k_dim, generator=gen))
    v = torch.randn(total, heads, v_dim, generator=gen)
    g = -2 * torch.rand(total, heads, generator=gen)
    beta = torch.rand(total, heads, generator=gen)
    h0 = torch.randn(len(lengths), heads, k_dim, v_dim, generator=gen)
    o, h = delta_rule_chunked_varlen(h0, q, k, v, g, beta, lengths, chunk_size=8)
    start = 0
    for r, n in enumerate(lengths):
        rows = slice(start, start + n)
        o_ref, h_ref = delta_rule_recurrence(h0[r], q[rows], k[rows], v[rows], g[rows], beta[rows])
        torch.testing.assert_close(o[rows], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[r], h_ref, atol=1e-5, rtol=1e-5)
        start += n


def test_the_packed_prefill_is_the_reference() -> None:
    """One layer, a step of prefill chunks of 7, 12 and 3 tokens beside a decode, from random
    conv and delta-rule states: the packed conv and chunked rule (chunks of 4) give the
    per-request reference's outputs and new states."""
    spec = GatedDeltaNetSpec(
        hidden_size=24,
        num_k_heads=2,
        num_v_heads=4,
        k_head_dim=8,
        v_head_dim=6,
        conv_kernel=4,
        norm_eps=1e-6,
        chunk_size=4,
    )
    gen = torch.Generator().manual_seed(7)
    layer = GatedDeltaNet(spec, state_index=0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    query_lens = [7, 1, 12, 3]
    hidden = torch.randn(sum(query_lens), spec.hidden_size, generator=gen)
    start = [
        torch.randn(len(query_lens), spec.conv_dim, spec.conv_kernel - 1, generator=gen),
        torch.randn(len(query_lens), spec.num_v_heads, spec.k_head_dim, spec.v_head_dim),
    ]
    seq_lens = [n + 5 for n in query_lens]
    tables = [[2 * i, 2 * i + 1] for i in range(len(query_lens))]
    metadata = make_attention_metadata(query_lens, seq_lens, tables, 16)
    results = []
    for reference in (False, True):
        layer.use_reference = reference
        pool = [t.clone() for t in start]
        ctx = ForwardContext(
            metadata, [], request_states=pool, state_slots=torch.arange(len(query_lens))
        )
        with torch.no_grad():
            results.append((layer(hidden, ctx), *pool))
    for fast, ref in zip(*results, strict=True):
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_the_layers_are_read(model_dir: Path) -> None:
    runner = StateRunner(model_dir)
    model = runner.model
    layers = model.model.layers
    assert [layer.linear_attn is not None for layer in layers] == [True, False, True]
    assert model.num_attention_layers == 1 and layers[1].self_attn.attn.layer_idx == 0
    # conv [2 * 32 + 64 channels, window - 1], state [value heads, k_dim, v_dim]
    assert [s.shape for s in model.request_state_specs()] == [(128, 3), (4, 16, 16)] * 2
    assert model.graph_capture_blocker() is not None
    assert model.needs_checkpoint_tensor("mtp.fc.weight") is False
    filled = model.load_weights([("mtp.fc.weight", torch.zeros(2, 2))])
    assert filled == set()
    with pytest.raises(ValueError, match="sliding_attention"):
        layer_types_of(
            SimpleNamespace(
                num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]
            )
        )
    with pytest.raises(ValueError, match="each of the 3 layers"):
        layer_types_of(SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention"]))


def test_a_forward_without_state_slots_starts_from_zero(model_dir: Path) -> None:
    check_forward_without_state_slots(model_dir)


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "setting", ["plain", "chunked-prefill", "two-slots", "preemption", "async"]
)
def test_greedy_tokens_match_transformers(model_dir: Path, setting: str) -> None:
    check_greedy_tokens(model_dir, setting)


def test_prefix_caching_is_off(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(Tensor parallelism: ``test_state_space_tp``.)"""
    from chassis.core.llm import LLM

    with caplog.at_level(logging.INFO, logger="chassis.core.request_state_cache"):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert llm.config.enable_prefix_caching is False
    assert "prefix caching is off" in caplog.text


def test_logprobs_match_transformers(model_dir: Path) -> None:
    check_logprobs(model_dir)


def test_bad_shapes_are_refused() -> None:
    fields = {
        "hidden_size": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 3,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    }
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        GatedDeltaNetSpec.from_config(SimpleNamespace(**fields))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        GatedDeltaNetSpec.from_config(
            SimpleNamespace(**{**fields, "hidden_act": "gelu", "linear_num_value_heads": 4})
        )
