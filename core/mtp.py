"""Multi-token-prediction (MTP) speculative decoding (``--speculative-config`` method
``mtp``, e.g. ``{"method": "mtp", "num_speculative_tokens": 1}``; vLLM's older names
``deepseek_mtp`` and ``glm4_moe_mtp`` mean the same).

DeepSeek-V3/R1 and GLM-4.5/4.6 checkpoints ship, past their decoder layers, MTP modules
trained to predict the token after next from the target's hidden state and the next token
(``builtin_plugins/models/deepseek_mtp.py`` says what they compute). Such a module is an
EAGLE-1-style head read from the target's own checkpoint, so the proposer is
:class:`~chassis.core.eagle.EagleProposer` unchanged: the head at position ``p`` reads the
token at ``p + 1`` and the target's final hidden state at ``p``; its KV cache (one layer:
the latent for DeepSeek's MLA, K/V heads for GLM-4.5) uses the target's block ids; draft
``j + 1`` feeds draft ``j`` and the head's own previous output; drafts are its argmax, or
draws from its ``q`` for unseeded random requests, verified exactly as a draft model's.

With ``num_speculative_tokens`` above the checkpoint's ``num_nextn_predict_layers`` (one for
the published checkpoints) the first module runs again on its own output for each further
draft, as vLLM does; only the first module is loaded.

Limits: targets of :class:`~chassis.builtin_plugins.models.deepseek_v2.DeepseekMoeForCausalLM`
(DeepSeek-V2/V3, GLM-4.5); the MTP module's ``embed_tokens`` is not read (the target's is
shared); ``"model"`` is not taken (the tensors are the target's own).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.config import EngineConfig
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)


def load_mtp_head(
    config: EngineConfig,
    target: CausalLM,
    attention_backend_cls: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Build the first MTP module of the target checkpoint ``config.model`` over ``target``
    on ``device`` in ``dtype`` and fill it from that checkpoint.

    ``ValueError`` (one line, naming what to change) when the target is not a DeepSeek-V3 /
    GLM-4.5 model, its config says no ``num_nextn_predict_layers``, its checkpoint holds no
    MTP tensors at ``model.layers.{num_hidden_layers}``, or a parameter is left unfilled.
    """
    from chassis.builtin_plugins.models.deepseek_mtp import (
        MtpHead,
        mtp_layer_prefix,
    )
    from chassis.core.model_interface import ModelBuildContext
    from chassis.core.model_loader import _default_dtype, resolve_model_path
    from chassis.core.quantized_weights import dequantized_weights
    from chassis.core.weights import checkpoint_keys, iterate_checkpoint

    spec = config.speculative
    if spec is None or not spec.uses_mtp or config.model is None:
        raise ValueError("load_mtp_head needs --speculative-config method 'mtp'")
    name = config.model
    hf_config = target.hf_config
    num_mtp = getattr(hf_config, "num_nextn_predict_layers", None) or 0
    if not isinstance(num_mtp, int) or num_mtp < 1:
        raise ValueError(
            f"--speculative-config method 'mtp': the checkpoint {name!r} has no multi-token-"
            f"prediction layers (config num_nextn_predict_layers is {num_mtp!r}); use a "
            "DeepSeek-V3/R1 or GLM-4.5 checkpoint that ships them, or another method"
        )
    path = resolve_model_path(name, load_format=config.load_format)
    prefix = mtp_layer_prefix(hf_config)
    names = [n for n in checkpoint_keys(path, config.load_format) if n.startswith(prefix)]
    if prefix + "eh_proj.weight" not in names:
        raise ValueError(
            f"--speculative-config method 'mtp': the checkpoint {name!r} says "
            f"num_nextn_predict_layers {num_mtp} but has no {prefix}eh_proj.weight (its MTP "
            "layer's tensors were left out of it?)"
        )
    build_ctx = ModelBuildContext(
        attention_backend=attention_backend_cls, dtype=dtype, max_model_len=config.max_model_len
    )
    own_lm_head = prefix + "shared_head.head.weight" in names
    with _default_dtype(dtype), torch.device(device):
        head = MtpHead(target, build_ctx, own_lm_head=own_lm_head)
    head.eval()
    weights = iterate_checkpoint(path, config.load_format, wanted=lambda n: n.startswith(prefix))
    loaded = head.load_weights(dequantized_weights(weights, hf_config))
    missing = sorted(n for n, _ in head.named_parameters() if n not in loaded)
    if missing:
        raise ValueError(f"the MTP layer of {name!r} lacks tensors for {missing}")
    logger.info(
        "MTP head loaded from %s (layer %d of %d MTP layers; %s LM head), %d drafts per step",
        name,
        head.layer_number,
        num_mtp,
        "its own" if own_lm_head else "the target's",
        spec.num_speculative_tokens,
    )
    return head
