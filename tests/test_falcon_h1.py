"""Falcon-H1 (``FalconH1ForCausalLM``: attention and a Mamba2 mixer in parallel in every
layer) against HF transformers on tiny random float32 checkpoints.

Two checkpoints: the releases' options (the mixer's gated RMSNorm after the gate,
``mamba_d_ssm`` narrower than ``mamba_expand * hidden_size``) and one without the mixer norm
(``y * silu(z)``), 2 groups and biases on ``in_proj``/``out_proj``; the logits of a third
have the norm before the gate. Every multiplier is far
from 1 (embedding, attention in/out, key, ssm in/out, the five ``ssm_multipliers``, MLP
gate/down, LM head), and every 1-D parameter is randomized (``save_tiny_checkpoint``).
Logits must match HF's over a packed prefill, a decode, a 2-token chunk over the carried
state and a mixed step (``check_logits`` of tests/state_space_helpers.py); greedy tokens
through ``LLM`` must be HF ``generate``'s, also with chunked prefill, two state slots and
preemption. A LoRA adapter naming the checkpoint's modules (``feed_forward.*``, ``mamba.*``)
gives HF's greedy tokens with the adapter merged into its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import greedy_with_adapters, hf_greedy, hf_merged_model, lora_engine
from fixtures_lora import write_peft_adapter as write_adapter
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from state_space_helpers import StateRunner, check_greedy_tokens, check_logits
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import hf_logits, load_hf

from chassis.core.lora import LoRARequest

ARCHS = ("released", "no_norm")
MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 3.0,
    "lm_head_multiplier": 0.25,
    "key_multiplier": 0.7,
    "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.6,
    "ssm_in_multiplier": 0.8,
    "ssm_out_multiplier": 1.4,
    "ssm_multipliers": [0.9, 1.2, 0.5, 1.5, 0.7],
    "mlp_multipliers": [1.6, 0.4],
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import FalconH1Config

    fields = {**TINY_CONFIG_FIELDS, **MULTIPLIERS}
    fields.update(
        num_hidden_layers=3,
        intermediate_size=48,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        mamba_conv_bias=True,
        tie_word_embeddings=False,
    )
    if arch == "released":
        fields.update(
            mamba_d_ssm=96,
            mamba_d_head=12,
            mamba_n_groups=1,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
        )
    else:
        fields.update(
            mamba_d_ssm=None,
            mamba_expand=2,
            mamba_d_head="auto",
            mamba_n_groups=2,
            mamba_rms_norm=False,
            mamba_proj_bias=True,
            projectors_bias=True,
        )
    return FalconH1Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_tiny_checkpoint(tiny_config(arch), tmp_path_factory.mktemp(arch), seed=11)
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_logits(model_dirs[arch])


def test_logits_with_the_norm_before_the_gate(tmp_path: Path) -> None:
    """``mamba_norm_before_gate: true``: ``rmsnorm(y) * silu(z)``, over 2 groups."""
    config = tiny_config("no_norm", mamba_rms_norm=True, mamba_norm_before_gate=True)
    check_logits(save_tiny_checkpoint(config, tmp_path, seed=11))


def test_the_multipliers_matter(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    """Each multiplier, reset to 1 (and the mixer norm's placement flipped), moves HF's own
    logits: a multiplier chassis ignored would fail the parity test."""
    prompt = TOKEN_PROMPTS[0]
    base = hf_logits(load_hf(model_dirs["released"]), prompt)
    changes: dict[str, Any] = {name: 1.0 for name in MULTIPLIERS}
    changes.update(
        ssm_multipliers=[1.0] * 5,
        mlp_multipliers=[1.0, 1.0],
        mamba_norm_before_gate=True,
    )
    for name, value in changes.items():
        model_dir = save_tiny_checkpoint(
            tiny_config("released", **{name: value}), tmp_path / name, seed=11
        )
        moved = hf_logits(load_hf(model_dir), prompt)
        assert (moved - base).abs().max() > 1e-3, name


def test_the_layers_are_read(model_dirs: dict[str, Path]) -> None:
    model = StateRunner(model_dirs["released"]).model
    assert model.num_attention_layers == 3
    assert [layer.self_attn.attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    # conv [conv_dim = 96 + 2 * 1 * 16, d_conv - 1], ssm [heads, head_dim, d_state]
    assert [s.shape for s in model.request_state_specs()] == [(128, 3), (8, 12, 16)] * 3
    assert model.model.layers[0].mamba.norm is not None
    assert StateRunner(model_dirs["no_norm"]).model.model.layers[0].mamba.norm is None
    assert model.graph_capture_blocker() is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_greedy_tokens(model_dirs[arch])


@pytest.mark.parametrize("setting", ["chunked-prefill", "two-slots", "preemption"])
def test_engine_settings_keep_the_tokens(model_dirs: dict[str, Path], setting: str) -> None:
    check_greedy_tokens(model_dirs["released"], setting)


def test_bad_ssm_multipliers_are_refused(model_dirs: dict[str, Path]) -> None:
    from chassis.builtin_plugins.models.falcon_h1 import falcon_h1_mamba_spec

    config = tiny_config("released")
    config.ssm_multipliers = [1.0, 2.0]
    with pytest.raises(ValueError, match="ssm_multipliers must be 5"):
        falcon_h1_mamba_spec(config)
    assert torch.is_tensor(
        StateRunner(model_dirs["released"]).model.model.layers[0].mamba.proj_scale
    )


#: every adaptable projection, by the checkpoint's names (``feed_forward.*``, ``mamba.*``)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS += ("in_proj", "out_proj")


def test_lora_slices_carry_the_checkpoint_names(model_dirs: dict[str, Path]) -> None:
    model = StateRunner(model_dirs["released"]).model
    names = {
        s.hf_module
        for module_name, module in model.named_modules()
        if module_name.startswith("model.layers.0.")
        for s in model.lora_slices(module_name, module)
    }
    assert names == {
        f"model.layers.0.{part}.{leaf}"
        for part, leaves in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("feed_forward", ("gate_proj", "up_proj", "down_proj")),
            ("mamba", ("in_proj", "out_proj")),
        )
        for leaf in leaves
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_adapter_matches_hf_merged(
    model_dirs: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """A random PEFT adapter on every projection (attention, mixer, MLP under its
    multipliers): greedy tokens equal HF's with the adapter merged into its weights, and
    differ from the base model's."""
    model_dir = model_dirs[arch]
    adapter = write_adapter(tmp_path / "a", model_dir, targets=LORA_TARGETS, magnitude=0.1)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [TOKEN_PROMPTS[0], TOKEN_PROMPTS[1]]
    got = greedy_with_adapters(lora_engine(model_dir), [lora, None], prompts, 8)
    base = hf_merged_model(model_dir, None, load_hf)
    assert got[0] == hf_greedy(hf_merged_model(model_dir, adapter, load_hf), prompts[0], 8)
    assert got[1] == hf_greedy(base, prompts[1], 8)
    assert got[0] != hf_greedy(base, prompts[0], 8)
