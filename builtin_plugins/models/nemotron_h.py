"""NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 8B/47B/56B, Nemotron Nano 2):
a stack of single-mixer blocks, each a Mamba2 mixer, an attention layer or an MLP.

As HF transformers' ``NemotronH`` code defines it: ``layers_block_type`` (from the
checkpoints' ``hybrid_override_pattern``: ``M`` mamba, ``*`` attention, ``-`` MLP) names each
block's mixer, and every block is ``x + mixer(norm(x))`` under ``backbone.layers.<i>``
(``mixer``, ``norm``). The mamba blocks are :class:`~chassis.core.layers.mamba2_mixer.
Mamba2Mixer` (``mamba_num_heads`` x ``mamba_head_dim``, ``ssm_state_size``, time steps
clamped below at ``time_step_min``); attention has no position encoding and the
``head_dim ** -0.5`` scale; the MLP is ``down_proj(relu(up_proj(x)) ** 2)``. The block norms
multiply their weight in float32 before rounding (unlike Llama's). ``moe`` blocks (Nemotron 3)
are refused, and tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.granitemoehybrid import NoPEAttention
from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    copy_checkpoint_tensor,
    filled_parameters,
)
from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import Mamba2Mixer, Mamba2Spec, check_silu
from chassis.core.layers.norm import RMSNorm
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec

#: ``layers_block_type`` values -> the block kind
_BLOCK_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
}
#: attention projections that load into rows of the merged ``qkv_proj``
_QKV = (".q_proj.", ".k_proj.", ".v_proj.")


def nemotron_h_block_kinds(hf_config: Any) -> list[str]:
    """``"mamba"``, ``"attention"`` or ``"mlp"`` per block; a ``ValueError`` for ``moe``
    blocks or an unknown kind."""
    types = list(getattr(hf_config, "layers_block_type", None) or [])
    if not types:
        raise ValueError("config layers_block_type (or hybrid_override_pattern) names no blocks")
    unknown = sorted({t for t in types if t not in _BLOCK_KINDS})
    if unknown:
        raise ValueError(
            f"Nemotron-H blocks of type {unknown} are not supported "
            f"(supported: {', '.join(sorted(set(_BLOCK_KINDS)))})"
        )
    return [_BLOCK_KINDS[t] for t in types]


def nemotron_h_mamba_spec(hf_config: Any) -> Mamba2Spec:
    check_silu(hf_config, "mamba_hidden_act")
    heads, head_dim = int(hf_config.mamba_num_heads), int(hf_config.mamba_head_dim)
    return Mamba2Spec(
        hidden_size=int(hf_config.hidden_size),
        num_heads=heads,
        head_dim=head_dim,
        d_state=int(hf_config.ssm_state_size),
        n_groups=int(hf_config.n_groups),
        d_conv=int(hf_config.conv_kernel),
        intermediate_size=heads * head_dim,
        chunk_size=int(hf_config.chunk_size),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.mamba_proj_bias),
        norm_eps=float(hf_config.layer_norm_epsilon),
        time_step_limit=(float(hf_config.time_step_min), float("inf")),
    )


class Fp32WeightRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normalized value before the cast back
    (Nemotron-H's rounding order)."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: None = None
    ) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class Relu2MLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    """``norm`` and one ``mixer`` (``kind``: mamba, attention or mlp); :meth:`forward`
    returns the mixer's output (the caller adds the residual)."""

    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.norm = Fp32WeightRMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.norm(hidden_states)
        if self.kind == "mamba":
            return self.mixer(x, ctx)
        if self.kind == "attention":
            return self.mixer(positions, x, ctx)
        return self.mixer(x)


class NemotronHBackbone(nn.Module):
    """HF's ``backbone``: embeddings, blocks, ``norm_f``."""

    def __init__(self, hf_config: Any, kinds: list[str], build_ctx: ModelBuildContext) -> None:
        super().__init__()
        hidden = int(hf_config.hidden_size)
        eps = float(hf_config.layer_norm_epsilon)
        self.embeddings = nn.Embedding(int(hf_config.vocab_size), hidden)
        mamba = nemotron_h_mamba_spec(hf_config) if "mamba" in kinds else None
        heads = int(hf_config.num_attention_heads)
        spec = DecoderSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf_config, "head_dim", None) or hidden // heads),
            intermediate_size=int(hf_config.intermediate_size),
            rms_norm_eps=eps,
            max_position=int(getattr(hf_config, "max_position_embeddings", 4096)),
            rope={"rope_type": "default", "rope_theta": 10000.0},  # unused: no rotation
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_bias=bool(getattr(hf_config, "attention_bias", False)),
        )
        mlp_act = getattr(hf_config, "mlp_hidden_act", "relu2")
        if "mlp" in kinds and mlp_act != "relu2":
            raise ValueError(f"mlp_hidden_act {mlp_act!r} is not supported (only 'relu2')")
        blocks = []
        for i, kind in enumerate(kinds):
            before = kinds[:i]
            mixer: nn.Module
            if kind == "mamba":
                assert mamba is not None
                mixer = Mamba2Mixer(mamba, state_index=2 * before.count("mamba"))
            elif kind == "attention":
                # no rotary table: NoPEAttention never rotates
                rotary: Any = None
                mixer = NoPEAttention(spec, rotary, before.count("attention"), build_ctx)
            else:
                mixer = Relu2MLP(hidden, spec.intermediate_size, bool(hf_config.mlp_bias))
            blocks.append(NemotronHBlock(kind, mixer, hidden, eps))
        self.layers = nn.ModuleList(blocks)
        self.norm_f = Fp32WeightRMSNorm(hidden, eps)
        self.spec = spec


class NemotronHForCausalLM(CausalLM):
    """``NemotronHForCausalLM`` checkpoints without ``moe`` blocks. Attention block ``j``
    (counting attention blocks) reads KV cache ``j``; mamba block ``m`` holds request-state
    tensors ``2m`` and ``2m + 1``."""

    has_recurrent_state = True

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.kinds = nemotron_h_block_kinds(hf_config)
        self.dtype = build_ctx.dtype
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", False))
        self.backbone = NemotronHBackbone(hf_config, self.kinds, build_ctx)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        hidden = int(hf_config.hidden_size)
        head_device = "meta" if self.tie_word_embeddings else None
        self.lm_head = nn.Linear(hidden, int(hf_config.vocab_size), bias=False, device=head_device)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def num_attention_layers(self) -> int:
        return nemotron_h_block_kinds(self.hf_config).count("attention")

    def request_state_specs(self) -> list[RequestStateSpec]:
        specs: list[RequestStateSpec] = []
        for i, block in enumerate(self.backbone.layers):
            if block.kind == "mamba":
                specs.extend(block.mixer.state_specs(f"layers.{i}.mixer", self.dtype))
        return specs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.backbone.layers:
            residual = hidden.float() if self.residual_in_fp32 else hidden
            hidden = residual + block(positions, hidden.to(self.dtype), ctx)
        return self.backbone.norm_f(hidden.to(self.dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in: attention's ``q_proj``/``k_proj``/``v_proj`` into rows
        of ``qkv_proj``, everything else by name; ``lm_head.weight`` skipped when tied.
        Unknown names and shapes that do not match raise ``ValueError``."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        shards_loaded: dict[str, set[str]] = {}
        for name, tensor in weights:
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            unknown = (
                f"checkpoint tensor {name!r} has no counterpart in {type(self).__name__}; "
                "is the checkpoint's architecture right?"
            )
            if any(part in name for part in _QKV):
                copy_checkpoint_tensor(
                    params, self.backbone.spec, name, tensor, shards_loaded, unknown=unknown
                )
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(unknown)
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)} (does config.json match the weights?)"
                )
            param.data.copy_(tensor)
            filled.add(name)
        return filled | filled_parameters(shards_loaded)
