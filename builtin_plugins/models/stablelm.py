"""StableLM (stabilityai/stablelm-3b-4e1t, stablelm-2-1_6b, stablelm-2-12b): the Llama
decoder with LayerNorm, partial RoPE and, optionally, a parallel residual and per-head q/k
LayerNorms.

As HF transformers' ``StableLm`` code defines it, a layer is::

    use_parallel_residual:  x = input_layernorm(h);  h = h + attn(x) + mlp(x)
    otherwise (default):    h = h + attn(input_layernorm(h))
                            h = h + mlp(post_attention_layernorm(h))

(:class:`~chassis.builtin_plugins.models.parallel_residual.ParallelResidualLayer`; a
parallel layer has no ``post_attention_layernorm``), and it differs from Llama in:

- every norm is ``nn.LayerNorm`` with a bias over ``layer_norm_eps``;
- RoPE rotates the first ``head_dim * partial_rotary_factor`` dimensions (HF's default
  0.25), rotate-half layout;
- ``use_qkv_bias`` puts a bias on q/k/v (stablelm-2); ``o_proj`` and the SwiGLU MLP never
  have one;
- ``qk_layernorm`` (stablelm-2-12b) normalizes each head of q and of k with *its own*
  bias-free ``nn.LayerNorm`` over ``head_dim`` before RoPE (``q_layernorm.norms.<h>``):
  :class:`PerHeadLayerNorm` stacks them, one row per head, and a tensor-parallel rank keeps
  the rows of its heads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    LlamaModel,
)
from chassis.builtin_plugins.models.parallel_residual import (
    ParallelResidualLayer,
    make_attention,
)
from chassis.builtin_plugins.models.starcoder2 import LayerNorm
from chassis.core import parallel_state
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext

#: HF's ``StableLmConfig`` default for ``partial_rotary_factor``
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
#: ``<layer prefix>.self_attn.{q,k}_layernorm.norms.<head>.weight``
_PER_HEAD_NORM = re.compile(r"^(.*\.self_attn)\.([qk])_layernorm\.norms\.(\d+)\.weight$")


class PerHeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over ``head_dim`` for each head, with its own weight:
    ``weight [num_heads, head_dim]``; ``forward(x [T, num_heads, head_dim])``. Computed in
    the input dtype, as HF's ``nn.LayerNorm``."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class StableLmForCausalLM(LlamaForCausalLM):
    """``StableLmForCausalLM`` checkpoints. The checkpoint's names are Llama's, but for the
    per-head q/k norms (:class:`PerHeadLayerNorm`); tensor parallelism and LoRA are
    Llama's."""

    norm_class = LayerNorm

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``layer_norm_eps``, ``use_qkv_bias``, ``qk_layernorm`` and
        partial RoPE (default 0.25); the MLP is SwiGLU (``hidden_act`` ``silu``)."""
        rope = rope_parameters(hf_config)
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
        return DecoderSpec.from_config(
            hf_config,
            rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-5)),
            rope=rope,
            qkv_bias=bool(getattr(hf_config, "use_qkv_bias", False)),
            o_bias=False,
            mlp_bias=False,
            qk_norm=bool(getattr(hf_config, "qk_layernorm", False)),
            sliding_window=None,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.parallel_residual = bool(getattr(hf_config, "use_parallel_residual", False))
        return LlamaModel(
            hf_config, self.spec, build_ctx, self.make_layer, norm_class=self.norm_class
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        spec = self.spec
        attention = make_attention(spec, rotary_emb, layer_idx, build_ctx)
        if spec.qk_norm:  # this rank's heads' norms, not Llama's one RMSNorm
            attention.q_norm = PerHeadLayerNorm(spec.num_heads, spec.head_dim, spec.rms_norm_eps)
            attention.k_norm = PerHeadLayerNorm(spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps)
        return ParallelResidualLayer(
            spec,
            attention,
            self.make_mlp(layer_idx),
            self.norm_class,
            parallel=self.parallel_residual,
            shared_norm=True,
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, with each head's q/k norm weight copied into its row of
        :class:`PerHeadLayerNorm` (rows of other ranks' heads skipped); a norm counts as
        filled once all of its rows arrived."""
        rows_loaded: dict[str, set[int]] = {}

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _PER_HEAD_NORM.match(name)
                if match is None:
                    yield name, tensor
                else:
                    self._load_head_norm(name, match, tensor, rows_loaded)

        loaded = super().load_weights(others())
        for param_name, rows in rows_loaded.items():
            if len(rows) == self.get_parameter(param_name).shape[0]:
                loaded.add(param_name)
        return loaded

    def _load_head_norm(
        self,
        name: str,
        match: re.Match[str],
        tensor: torch.Tensor,
        rows_loaded: dict[str, set[int]],
    ) -> None:
        prefix, which, head = match.group(1), match.group(2), int(match.group(3))
        param_name = f"{prefix}.{which}_norm.weight"
        try:
            param = self.get_parameter(param_name)
        except AttributeError:
            raise ValueError(
                f"checkpoint tensor {name!r} has no counterpart in {type(self).__name__} "
                "(config qk_layernorm is false, or the layer index is out of range)"
            ) from None
        full = self.full_spec
        if which == "q":
            first, count = parallel_state.shard(full.num_heads, "num_attention_heads")
            total = full.num_heads
        else:
            first, count = parallel_state.shard_kv_heads(full.num_kv_heads)
            total = full.num_kv_heads
        if head >= total or tensor.shape != param.shape[1:]:
            raise ValueError(
                f"checkpoint tensor {name!r} (shape {tuple(tensor.shape)}) does not fit "
                f"{total} heads of {full.head_dim} (does config.json match the weights?)"
            )
        if first <= head < first + count:
            param[head - first].copy_(tensor)
            rows_loaded.setdefault(param_name, set()).add(head)
