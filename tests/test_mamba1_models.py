"""Mamba-1 mixers against HF transformers on tiny random float32 checkpoints:
``MambaForCausalLM`` and ``FalconMambaForCausalLM`` (its weightless dt/B/C norms).

The mixers have 128 channels, d_state 16, conv window 4 and dt rank 8; A_log, D, the dt
bias, conv biases and every norm weight are randomized. Logits must match HF's (the steps of
``state_space_helpers.check_logits``: two requests' prefill packed in one step, a decode, a
2-token chunk over the carried state, a step mixing a chunk and a decode); greedy tokens
through ``LLM`` must be HF ``generate``'s, also with chunked prefill, preemption and more
requests than state slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from state_space_helpers import (
    StateRunner,
    check_forward_without_state_slots,
    check_greedy_tokens,
    check_logits,
    check_prefill,
    check_prefix_caching_off,
    check_spec_decoding_refused,
)
from test_models_parity import PROMPTS as TOKEN_PROMPTS

from chassis.builtin_plugins.models.sparse_moe import SparseMoeBlock
from chassis.core.layers.mamba_mixer import MambaMixer
from chassis.core.layers.selective_scan import selective_scan_varlen, selective_step

ARCHS = ("mamba", "falcon_mamba", "jamba")


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import FalconMambaConfig, JambaConfig, MambaConfig

    if arch == "jamba":
        # layers: mamba + MoE, mamba + MLP, attention + MoE, mamba + MLP
        fields = {
            **TINY_CONFIG_FIELDS,
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 0,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "mamba_d_state": 16,
            "mamba_dt_rank": 8,
            "tie_word_embeddings": False,
        }
        return JambaConfig(**{**fields, **overrides})

    fields = {
        key: TINY_CONFIG_FIELDS[key]
        for key in ("vocab_size", "hidden_size", "bos_token_id", "eos_token_id", "pad_token_id")
    }
    fields.update(
        num_hidden_layers=3,
        state_size=16,
        conv_kernel=4,
        expand=2,
        time_step_rank=8,
        tie_word_embeddings=arch == "falcon_mamba",  # both ways
    )
    if arch == "falcon_mamba":
        return FalconMambaConfig(**{**fields, "mixer_rms_eps": 1e-5, **overrides})
    return MambaConfig(**{**fields, **overrides})


def save_checkpoint(config: Any, directory: Path) -> Path:
    """``save_tiny_checkpoint``, then ``A_log`` (HF's init is ``log(1..N)`` in every
    channel) perturbed per channel, so that a transposed or misplaced ``A`` shows."""
    save_tiny_checkpoint(config, directory, seed=5)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("A_log"):
            tensors[name] = tensor + 0.5 * torch.randn(tensor.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_checkpoint(tiny_config(arch), tmp_path_factory.mktemp(arch)) for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_logits(model_dirs[arch])


def test_the_model_reads_its_shapes(model_dirs: dict[str, Path]) -> None:
    model = StateRunner(model_dirs["mamba"]).model
    assert model.num_attention_layers == 0 and model.graph_capture_blocker() is not None
    # conv [intermediate, d_conv - 1], ssm [intermediate, d_state] per layer
    assert [s.shape for s in model.request_state_specs()] == [(128, 3), (128, 16)] * 3
    falcon = StateRunner(model_dirs["falcon_mamba"]).model
    assert falcon.lm_head.weight is falcon.backbone.embeddings.weight
    assert falcon.backbone.layers[0].mixer.spec.bcdt_norm == "weightless"
    jamba = StateRunner(model_dirs["jamba"]).model
    layers = jamba.model.layers
    assert [layer.mamba is not None for layer in layers] == [True, True, False, True]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False] * 2
    assert jamba.num_attention_layers == 1 and layers[2].self_attn.attn.layer_idx == 0
    assert [layer.mamba.state_index for layer in layers if layer.mamba] == [0, 2, 4]
    assert layers[0].mlp.experts.renormalize is False  # Jamba keeps the top-k probabilities


def test_a_wrong_activation_is_refused(tmp_path: Path) -> None:
    from chassis.core.llm import LLM

    save_checkpoint(tiny_config("mamba", hidden_act="gelu"), tmp_path)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, num_kv_blocks=8)


@pytest.mark.parametrize("reference", [False, True], ids=["parallel", "reference"])
def test_the_varlen_scan_is_the_step_by_step_recurrence(reference: bool) -> None:
    """The prefill scan of several packed requests (padded with dt = 0; the parallel scan in
    chunks of 3 tokens) equals :func:`selective_step` token after token for each, from
    nonzero states."""
    gen = torch.Generator().manual_seed(0)
    inner, d_state = 12, 5
    A = -torch.rand(inner, d_state, generator=gen) - 0.1
    D = torch.randn(inner, generator=gen)
    lengths = (1, 7, 3, 11)
    total = sum(lengths)
    x = torch.randn(total, inner, generator=gen)
    dt = torch.rand(total, inner, generator=gen)
    B = torch.randn(total, d_state, generator=gen)
    C = torch.randn(total, d_state, generator=gen)
    h0 = torch.randn(len(lengths), inner, d_state, generator=gen)
    chunk_elements = 3 * len(lengths) * inner * d_state
    y, h = selective_scan_varlen(
        h0, x, dt, A, B, C, D, lengths, reference=reference, max_chunk_elements=chunk_elements
    )
    start = 0
    for r, n in enumerate(lengths):
        state = h0[r : r + 1]
        for t in range(start, start + n):
            one = slice(t, t + 1)
            y_t, state = selective_step(state, x[one], dt[one], A, B[one], C[one], D)
            torch.testing.assert_close(y[t], y_t[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[r], state[0], atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("reference", [False, True], ids=["parallel", "reference"])
def test_both_scans_match_transformers(model_dirs: dict[str, Path], reference: bool) -> None:
    """The model with either prefill scan (the token loop is the CPU default) gives HF's
    logits."""
    runner = StateRunner(model_dirs["jamba"])
    runner.use_reference(MambaMixer, reference)
    check_prefill(runner, model_dirs["jamba"], TOKEN_PROMPTS[0])


def test_a_forward_without_state_slots_starts_from_zero(model_dirs: dict[str, Path]) -> None:
    check_forward_without_state_slots(model_dirs["jamba"])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_greedy_tokens(model_dirs[arch])


@pytest.mark.parametrize(
    ("arch", "setting"),
    [
        # Jamba: attention layers need KV blocks, so it can be preempted
        ("jamba", "chunked-prefill"),
        ("jamba", "two-slots"),
        ("jamba", "preemption"),
        ("falcon_mamba", "chunked-prefill"),
    ],
)
def test_engine_settings_keep_the_tokens(
    model_dirs: dict[str, Path], arch: str, setting: str
) -> None:
    check_greedy_tokens(model_dirs[arch], setting)


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_prefix_caching_is_off_and_spec_decoding_refused(
    model_dirs: dict[str, Path], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    check_prefix_caching_off(model_dirs[arch], caplog)
    check_spec_decoding_refused(model_dirs[arch])
