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
are refused.

Tensor parallel: each rank keeps its share of the attention heads (and KV heads, as Llama's),
of the MLP columns (``up_proj`` rows, ``down_proj`` columns) and of every mixer's heads and
groups (:mod:`chassis.core.layers.mamba2_shard`); ``o_proj``, ``down_proj`` and the mixers'
outputs are summed over the group. The embeddings, norms and LM head are whole on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.backbone_lm import BackboneLM, NormMixerBlock
from chassis.builtin_plugins.models.granitemoehybrid import NoPEAttention
from chassis.builtin_plugins.models.llama import DecoderSpec, copy_checkpoint_tensor
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import Mamba2Mixer, Mamba2Spec, check_silu
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.layers.norm import RMSNorm
from chassis.core.model_interface import ModelBuildContext

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
    """``down_proj(relu(up_proj(x)) ** 2)``; ``intermediate_size`` is this rank's share of the
    columns, and the output is summed over the tensor-parallel group."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_state.all_reduce(self.down_proj(torch.relu(self.up_proj(x)).square()))


class NemotronHBlock(NormMixerBlock):
    """``norm`` and one ``mixer`` (``kind``: mamba, attention or mlp); :meth:`forward`
    returns the mixer's output (the caller adds the residual)."""

    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__(Fp32WeightRMSNorm(hidden_size, eps), mixer)
        self.kind = kind

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
        #: the whole layers' shapes (the checkpoint's), and this rank's share
        self.full_spec = spec
        spec = spec.tensor_parallel_share()
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


class NemotronHForCausalLM(BackboneLM):
    """``NemotronHForCausalLM`` checkpoints without ``moe`` blocks. Attention block ``j``
    (counting attention blocks) reads KV cache ``j``; mamba block ``m`` holds request-state
    tensors ``2m`` and ``2m + 1``."""

    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        if "mamba" in nemotron_h_block_kinds(hf_config):
            mamba2_shard(nemotron_h_mamba_spec(hf_config), size, 0)
        if int(hf_config.intermediate_size) % size:  # (the MLP blocks' columns)
            raise ValueError(
                f"intermediate_size ({hf_config.intermediate_size}) is not divisible by "
                f"--tensor-parallel-size {size}"
            )

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        kinds = nemotron_h_block_kinds(hf_config)
        backbone = NemotronHBackbone(hf_config, kinds, build_ctx)
        super().__init__(
            hf_config, build_ctx, backbone, residual_in_fp32=False, tie_word_embeddings=False
        )
        self.kinds = kinds

    @property
    def num_attention_layers(self) -> int:
        return nemotron_h_block_kinds(self.hf_config).count("attention")

    def copy_tensor(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        tensor: torch.Tensor,
        shards_loaded: dict[str, set[str]],
    ) -> None:
        """As :meth:`BackboneLM.copy_tensor`, attention and MLP tensors cut to this rank's
        part first; attention's ``q_proj``/``k_proj``/``v_proj`` go into rows of
        ``qkv_proj``."""
        tensor = self._tensor_parallel_slice(name, tensor)
        if not any(part in name for part in _QKV):
            super().copy_tensor(params, name, tensor, shards_loaded)
            return
        copy_checkpoint_tensor(
            params,
            self.backbone.spec,
            name,
            tensor,
            shards_loaded,
            unknown=self.unknown_tensor(name),
        )

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of an attention or MLP checkpoint tensor: the rows of its query
        heads (``q_proj``), KV heads (``k_proj``/``v_proj``) and MLP columns (``up_proj``),
        the columns of ``o_proj``/``down_proj`` (whose biases rank 0 alone adds). Other
        tensors are returned whole."""
        if parallel_state.tp_size() == 1 or ".mixer." not in name:
            return tensor
        leaf = name.split(".")[-2]
        full = self.backbone.full_spec
        if leaf == "q_proj":
            first, count = parallel_state.shard(full.num_heads, "num_attention_heads")
        elif leaf in ("k_proj", "v_proj"):
            first, count = parallel_state.shard_kv_heads(full.num_kv_heads)
        elif leaf == "up_proj":
            start, length = parallel_state.shard(tensor.shape[0], name)
            return tensor[start : start + length]
        elif leaf in ("o_proj", "down_proj"):
            if name.endswith(".bias"):
                return tensor if parallel_state.tp_rank() == 0 else torch.zeros_like(tensor)
            start, length = parallel_state.shard(tensor.shape[1], name)
            return tensor[:, start : start + length]
        else:
            return tensor
        return tensor[first * full.head_dim : (first + count) * full.head_dim]
