"""TII Falcon-H1 (``FalconH1ForCausalLM``: Falcon-H1-0.5B/1.5B/3B/7B/34B, base and instruct):
every layer runs attention and a Mamba2 mixer side by side on the same normed input.

As HF transformers' ``FalconH1`` code defines it, layer ``i`` is

    h = x + ssm_out_multiplier * mamba(n) + attention_out_multiplier * attn(attention_in_multiplier * n)
    out = h + mlp(pre_ff_layernorm(h)),  n = input_layernorm(x)

- the mixer (``mamba.*``) is :class:`~chassis.core.layers.mamba2_mixer.Mamba2Mixer` with
  Falcon-H1's options: ``mamba_d_ssm`` wide (else ``mamba_expand * hidden_size``), its input
  scaled by ``ssm_in_multiplier`` and ``in_proj``'s parts (z, x, B, C, dt) by
  ``ssm_multipliers``; ``mamba_rms_norm`` adds the gated RMSNorm (before the gate with
  ``mamba_norm_before_gate``), otherwise ``y * silu(z)``; ``out_proj``'s bias is
  ``projectors_bias``;
- attention is Llama's (RoPE, GQA) with keys scaled by ``key_multiplier``;
- the SwiGLU MLP scales the gate by ``mlp_multipliers[0]`` before SiLU and the output by
  ``mlp_multipliers[1]``;
- the embeddings are scaled by ``embedding_multiplier``, the logits by ``lm_head_multiplier``.

Every layer has a KV cache and a request state (conv window and SSM state). The checkpoint's
``feed_forward``, ``pre_ff_layernorm`` and ``model.final_layernorm`` load as the Llama
decoder's ``mlp``, ``post_attention_layernorm`` and ``model.norm``
(:attr:`FalconH1ForCausalLM.checkpoint_renames`; LoRA adapters name ``feed_forward.*``).

Tensor parallel: attention, MLP, embeddings and LM head as Llama's (the MLP's output summed
over the group, the logits gathered); each mixer keeps this rank's heads and groups
(:mod:`chassis.core.layers.mamba2_shard`: ``mamba_n_heads`` must divide by the ranks,
``mamba_n_groups`` divide them or by them) and its output is summed over the group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.granitemoehybrid import granite_mamba_spec
from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
)
from chassis.builtin_plugins.models.parallel_residual import CheckpointRenames
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import (
    Mamba2Mixer,
    Mamba2Spec,
    ShardedMixer,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.vocab_parallel import gather_logits
from chassis.core.model_interface import ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec


def _multiplier(hf_config: Any, name: str) -> float:
    value = getattr(hf_config, name, None)
    return 1.0 if value is None else float(value)


def falcon_h1_mamba_spec(hf_config: Any) -> Mamba2Spec:
    """The mixer of a ``FalconH1Config``: Bamba's ``mamba_*`` fields, ``mamba_d_ssm`` wide
    when set, with Falcon-H1's norm placement, projector bias and multipliers."""
    d_ssm = getattr(hf_config, "mamba_d_ssm", None)
    multipliers = getattr(hf_config, "ssm_multipliers", None) or [1.0] * 5
    if len(multipliers) != 5:
        raise ValueError(f"ssm_multipliers must be 5 numbers (z, x, B, C, dt), got {multipliers}")
    if not getattr(hf_config, "mamba_rms_norm", False):
        gate_norm = "gate"
    elif getattr(hf_config, "mamba_norm_before_gate", True):
        gate_norm = "norm_then_gate"
    else:
        gate_norm = "gate_then_norm"
    return granite_mamba_spec(
        hf_config,
        None if d_ssm is None else int(d_ssm),
        out_proj_bias=bool(getattr(hf_config, "projectors_bias", False)),
        gate_norm=gate_norm,
        in_multiplier=_multiplier(hf_config, "ssm_in_multiplier"),
        proj_multipliers=tuple(float(m) for m in multipliers),
    )


class KeyScaledAttention(LlamaAttention):
    """Llama's attention with the keys scaled by ``key_multiplier`` (after RoPE, which is
    linear in them)."""

    key_multiplier: float = 1.0

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().encode_positions(positions, q, k)
        return q, k * self.key_multiplier


class FalconH1MLP(nn.Module):
    """``down_proj(silu(gate_multiplier * gate) * up) * down_multiplier``, gate and up merged
    in ``gate_up_proj`` (this rank's columns; the output summed over the tensor-parallel
    group)."""

    def __init__(self, spec: DecoderSpec, gate_multiplier: float, down_multiplier: float) -> None:
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=spec.mlp_bias)
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier
        return parallel_state.all_reduce(out)


class FalconH1DecoderLayer(nn.Module):
    """The mixer (``mamba``) and attention (``self_attn``) in parallel, then the MLP; returns
    ``(mlp output, residual stream)`` as :class:`~chassis.builtin_plugins.models.llama.
    LlamaDecoderLayer`."""

    def __init__(
        self,
        spec: DecoderSpec,
        mamba: Mamba2Mixer,
        self_attn: nn.Module,
        mlp: nn.Module,
        multipliers: dict[str, float],
    ) -> None:
        super().__init__()
        self.mamba = mamba
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.ssm_out_multiplier = multipliers["ssm_out_multiplier"]
        self.attention_in_multiplier = multipliers["attention_in_multiplier"]
        self.attention_out_multiplier = multipliers["attention_out_multiplier"]

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        ssm = self.mamba(hidden_states, ctx) * self.ssm_out_multiplier
        attn = self.self_attn(positions, hidden_states * self.attention_in_multiplier, ctx)
        hidden_states = ssm + attn * self.attention_out_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class FalconH1ForCausalLM(CheckpointRenames, LlamaForCausalLM):
    """``FalconH1ForCausalLM`` checkpoints. Layer ``i`` reads KV cache ``i`` and holds
    request-state tensors ``2i`` (conv) and ``2i + 1`` (SSM). Refused when built: a
    ``hidden_act`` other than ``silu``, mixer shapes that do not fit (or do not split over
    ``--tensor-parallel-size``)."""

    has_recurrent_state = True
    checkpoint_renames = (
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        (".model.final_layernorm.", ".model.norm."),
    )

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        mamba2_shard(falcon_h1_mamba_spec(hf_config), size, 0)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.mamba_spec = falcon_h1_mamba_spec(hf_config)
        self.state_dtype = build_ctx.dtype
        names = ("ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier")
        self.multipliers = {name: _multiplier(hf_config, name) for name in names}
        self.key_multiplier = _multiplier(hf_config, "key_multiplier")
        self.lm_head_multiplier = _multiplier(hf_config, "lm_head_multiplier")
        mlp = getattr(hf_config, "mlp_multipliers", None) or [1.0, 1.0]
        if len(mlp) != 2:
            raise ValueError(f"mlp_multipliers must be 2 numbers (gate, down), got {mlp}")
        self.mlp_multipliers = (float(mlp[0]), float(mlp[1]))
        return LlamaModel(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            embedding_multiplier=_multiplier(hf_config, "embedding_multiplier"),
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> FalconH1DecoderLayer:
        attention = KeyScaledAttention(self.spec, rotary_emb, layer_idx, build_ctx)
        attention.key_multiplier = self.key_multiplier
        return FalconH1DecoderLayer(
            self.spec,
            Mamba2Mixer(self.mamba_spec, state_index=2 * layer_idx),
            attention,
            FalconH1MLP(self.spec, *self.mlp_multipliers),
            self.multipliers,
        )

    def request_state_specs(self) -> list[RequestStateSpec]:
        specs: list[RequestStateSpec] = []
        for i, layer in enumerate(self.model.layers):
            specs.extend(layer.mamba.state_specs(f"layers.{i}.mamba", self.state_dtype))
        return specs

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return (logits * self.lm_head_multiplier).float()

    @functools.cached_property
    def _mamba_mixers(self) -> dict[str, ShardedMixer]:
        return mamba2_mixers(self)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As Llama's, and a mixer's tensors cut by :func:`mamba2_checkpoint_part`."""
        if ".mamba." in name:
            return mamba2_checkpoint_part(self._mamba_mixers, name, tensor)
        return super()._tensor_parallel_slice(name, tensor)
