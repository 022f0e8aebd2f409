"""Mamba2 (``Mamba2ForCausalLM``: state-spaces/mamba2-*, mistralai/Mamba-Codestral-7B): a
stack of Mamba2 mixers, no attention.

As HF transformers' ``Mamba2`` code defines it: ``backbone.embeddings``; each block
``backbone.layers.<i>`` is ``x + mixer(norm(x))`` (an RMSNorm, then a
:class:`~chassis.core.layers.mamba2_mixer.Mamba2Mixer`), the residual stream kept in float32
with ``residual_in_fp32``; ``backbone.norm_f``; ``lm_head`` (tied to the embeddings with
``tie_word_embeddings``): a :class:`~chassis.builtin_plugins.models.backbone_lm.BackboneLM`.
No KV cache: every layer carries a state per request.

Tensor parallel: each rank keeps its share of every mixer's heads and groups
(:mod:`chassis.core.layers.mamba2_shard`; ``num_heads`` must divide by the ranks, and
``n_groups`` divide them or by them), and the mixers' outputs are summed over the group; the
embeddings, norms and LM head are whole on every rank.
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.backbone_lm import BackboneLM, rms_norm_backbone
from chassis.core.layers.mamba2_mixer import Mamba2Mixer, Mamba2Spec, check_silu
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.model_interface import ModelBuildContext


def mamba2_spec(hf_config: Any) -> Mamba2Spec:
    """The mixer of a ``Mamba2Config``."""
    check_silu(hf_config)
    hidden = int(hf_config.hidden_size)
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Spec(
        hidden_size=hidden,
        num_heads=int(hf_config.num_heads),
        head_dim=int(hf_config.head_dim),
        d_state=int(hf_config.state_size),
        n_groups=int(hf_config.n_groups),
        d_conv=int(hf_config.conv_kernel),
        intermediate_size=int(hf_config.expand * hidden),
        chunk_size=int(getattr(hf_config, "chunk_size", 256) or 256),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        norm_eps=float(hf_config.layer_norm_epsilon),
        time_step_limit=(float(limit[0]), float(limit[1])),
    )


class Mamba2ForCausalLM(BackboneLM):
    """``Mamba2ForCausalLM`` checkpoints. Layer ``i`` holds request-state tensors ``2i``
    (conv) and ``2i + 1`` (SSM). Refused when built: a ``hidden_act`` other than ``silu``,
    mixer shapes that do not fit, or that do not split over ``--tensor-parallel-size``."""

    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        mamba2_shard(mamba2_spec(hf_config), size, 0)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        spec = mamba2_spec(hf_config)
        backbone = rms_norm_backbone(
            hf_config, spec.hidden_size, lambda i: Mamba2Mixer(spec, 2 * i)
        )
        super().__init__(
            hf_config, build_ctx, backbone, residual_in_fp32=True, tie_word_embeddings=False
        )
        self.spec = spec

    @property
    def num_attention_layers(self) -> int:
        return 0

    def checkpoint_name(self, name: str) -> str:
        """Older checkpoints' ``backbone.embedding`` is ``backbone.embeddings``."""
        return name.replace("backbone.embedding.", "backbone.embeddings.")
