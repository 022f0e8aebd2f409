"""Mamba (``MambaForCausalLM``: state-spaces/mamba-*-hf) and Falcon Mamba
(``FalconMambaForCausalLM``: tiiuae/falcon-mamba-7b): stacks of Mamba-1 mixers, no attention.

As HF transformers' ``Mamba`` / ``FalconMamba`` code defines them: ``backbone.embeddings``;
each block ``backbone.layers.<i>`` is ``x + mixer(norm(x))`` (an RMSNorm, then a
:class:`~chassis.core.layers.mamba_mixer.MambaMixer`), the residual stream in float32 with
``residual_in_fp32``; ``backbone.norm_f``; ``lm_head`` (tied with ``tie_word_embeddings``).
Falcon Mamba adds weightless RMS norms (``mixer_rms_eps``) on the mixer's ``dt``, ``B`` and
``C``. The model is a :class:`~chassis.builtin_plugins.models.backbone_lm.BackboneLM` (the
backbone, embeddings and loading Mamba-2's uses too), with the Mamba-1 mixer.

Tensor parallel: each mixer keeps ``intermediate / N`` channels (``x_proj``'s and
``out_proj``'s partial outputs summed over the group: :mod:`~chassis.core.layers.mamba_mixer`);
the embeddings, norms and LM head are whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from chassis.builtin_plugins.models.backbone_lm import BackboneLM, rms_norm_backbone
from chassis.core.layers.mamba2_mixer import check_silu
from chassis.core.layers.mamba_mixer import BcdtNorm, MambaMixer, MambaSpec
from chassis.core.model_interface import ModelBuildContext


def mamba_spec(hf_config: Any, bcdt_norm: BcdtNorm = "none") -> MambaSpec:
    """The mixer of a ``MambaConfig`` / ``FalconMambaConfig``."""
    check_silu(hf_config)
    hidden = int(hf_config.hidden_size)
    rank = getattr(hf_config, "time_step_rank", "auto")
    return MambaSpec(
        hidden_size=hidden,
        intermediate_size=int(
            getattr(hf_config, "intermediate_size", None) or int(hf_config.expand) * hidden
        ),
        d_state=int(hf_config.state_size),
        d_conv=int(hf_config.conv_kernel),
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        bcdt_norm=bcdt_norm,
        bcdt_norm_eps=float(getattr(hf_config, "mixer_rms_eps", 1e-6)),
    )


class MambaForCausalLM(BackboneLM):
    """``MambaForCausalLM`` checkpoints. Layer ``i`` holds request-state tensors ``2i``
    (conv ``[intermediate, d_conv - 1]``) and ``2i + 1`` (SSM ``[intermediate, d_state]``).
    Refused when built: a ``hidden_act`` other than ``silu``, shapes that do not fit."""

    #: how the mixers normalize dt, B and C (see :data:`~chassis.core.layers.mamba_mixer.
    #: BcdtNorm`)
    bcdt_norm: BcdtNorm = "none"
    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        inner = mamba_spec(hf_config, cls.bcdt_norm).intermediate_size
        if inner % size:
            raise ValueError(
                f"the Mamba mixer's intermediate_size ({inner}) is not divisible by "
                f"--tensor-parallel-size {size}"
            )

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        spec = mamba_spec(hf_config, self.bcdt_norm)
        backbone = rms_norm_backbone(hf_config, spec.hidden_size, lambda i: MambaMixer(spec, 2 * i))
        super().__init__(
            hf_config, build_ctx, backbone, residual_in_fp32=True, tie_word_embeddings=True
        )
        self.spec = spec

    @property
    def num_attention_layers(self) -> int:
        return 0

    def checkpoint_name(self, name: str) -> str:
        """Older checkpoints' ``backbone.embedding`` is ``backbone.embeddings``."""
        return name.replace("backbone.embedding.", "backbone.embeddings.")


class FalconMambaForCausalLM(MambaForCausalLM):
    """``FalconMambaForCausalLM`` checkpoints: Mamba with weightless RMS norms on the mixers'
    ``dt``, ``B`` and ``C`` (``mixer_rms_eps``)."""

    bcdt_norm: BcdtNorm = "weightless"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Mamba's; the mixers' ``*_layernorm.weight`` tensors some checkpoints carry
        are skipped (HF keeps them only as stand-ins for a fused kernel and never reads
        them)."""
        return super().load_weights(
            (name, tensor) for name, tensor in weights if not name.endswith("layernorm.weight")
        )
