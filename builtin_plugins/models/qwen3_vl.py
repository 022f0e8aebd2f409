"""Qwen3-VL and Qwen3-VL-MoE: the multimodal checkpoints' Qwen3 / Qwen3-MoE language model,
served as text only.

Their language model rotates q and k by interleaved M-RoPE (``mrope_interleaved``): three
position ids per token (temporal, height, width); frequency ``j`` is turned by the height
component when ``j % 3 == 1`` (within ``3 * mrope_section[1]``), by the width one when
``j % 3 == 2`` (within ``3 * mrope_section[2]``), else by the temporal one. For text, HF gives
the three components the same value (the token's index), so every frequency is turned by that
one position: the rotation is ordinary (1D, rotate-half) RoPE with the text config's
``rope_theta`` (tests/test_multimodal_text_models.py checks the tables against HF's). The
``deepstack`` inputs add vision features to the first layers' hidden states at image
positions only; a text prompt has none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM
from chassis.builtin_plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, qwen_moe_spec
from chassis.builtin_plugins.models.text_only import TextOnlyWeights, wrapper_tie_word_embeddings

#: a Qwen3-VL-MoE layer's experts stored stacked: ``<block>.experts.gate_up_proj`` /
#: ``<block>.experts.down_proj`` (no ``.weight``), after the language-model rename
_STACKED_EXPERTS = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


class Qwen3VLForConditionalGeneration(TextOnlyWeights, Qwen3ForCausalLM):
    """``Qwen3VLForConditionalGeneration`` checkpoints served as text only (Qwen3's decoder:
    RMSNorm on each q/k head, ``head_dim`` from the config, ``attention_bias`` on all four
    projections, no sliding window).

    Files name the language model ``model.language_model.*`` and ``lm_head.*``; the vision
    tower (``model.visual.*``, its deepstack mergers included) is never read. The LM head is
    tied by the checkpoint's top-level ``tie_word_embeddings``, as in transformers.
    """

    language_model_prefixes = (("model.language_model.", "model."),)
    vision_prefixes = ("model.visual.", "visual.")

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qk_norm=True, sliding_window=None)

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))


class Qwen3VLMoeForConditionalGeneration(TextOnlyWeights, Qwen3MoeForCausalLM):
    """``Qwen3VLMoeForConditionalGeneration`` checkpoints (Qwen3-VL-30B-A3B,
    Qwen3-VL-235B-A22B) served as text only: Qwen3-MoE's decoder, whose router always
    renormalizes its top-k weights (HF's ``Qwen3VLMoeTextTopKRouter`` does, whatever
    ``norm_topk_prob`` says).

    Names as Qwen3-VL. Each sparse layer's experts come stacked: ``experts.gate_up_proj``
    (hub files ``[experts, hidden, 2 * moe_intermediate]``, gate columns first) and
    ``experts.down_proj`` (``[experts, moe_intermediate, hidden]``); transformers 5 writes
    them in its in-memory layout (the last two dimensions swapped), which is read too,
    telling the two apart by shape as transformers does. The LM head is tied by the
    checkpoint's top-level ``tie_word_embeddings`` (the text config's class defaults its own
    to true; the released config.json sets the top-level one false).
    """

    language_model_prefixes = (("model.language_model.", "model."),)
    vision_prefixes = ("model.visual.", "visual.")

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qk_norm=True, sliding_window=None)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return dataclasses.replace(qwen_moe_spec(hf_config, shared_expert=False), renormalize=True)

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the base, with each stacked expert tensor given as the per-expert
        ``experts.<e>.{gate_proj,up_proj,down_proj}.weight`` matrices."""
        return super().load_weights(self._per_expert(weights))

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        hidden = self.full_spec.hidden_size
        inter = self.moe_spec(self.hf_config).intermediate_size
        for name, tensor in weights:
            match = _STACKED_EXPERTS.match(self.language_model_name(name))
            if match is None:
                yield name, tensor
                continue
            block, proj = match["block"], match["proj"]
            if proj == "gate_up_proj":
                # ours: [experts, 2 * inter, hidden] (transformers' in-memory layout)
                stacked = _as_layout(name, tensor, (2 * inter, hidden))
                for expert, matrix in enumerate(stacked):
                    yield f"{block}.experts.{expert}.gate_proj.weight", matrix[:inter]
                    yield f"{block}.experts.{expert}.up_proj.weight", matrix[inter:]
            else:
                stacked = _as_layout(name, tensor, (hidden, inter))
                for expert, matrix in enumerate(stacked):
                    yield f"{block}.experts.{expert}.down_proj.weight", matrix


def _as_layout(name: str, tensor: torch.Tensor, rows_cols: tuple[int, int]) -> torch.Tensor:
    """``tensor [experts, a, b]`` as ``[experts, *rows_cols]``: as it is when it has that
    shape, else with its last two dimensions swapped (transformers' rule)."""
    if tensor.dim() == 3 and tuple(tensor.shape[1:]) == rows_cols:
        return tensor
    if tensor.dim() == 3 and tuple(tensor.shape[1:]) == rows_cols[::-1]:
        return tensor.transpose(1, 2)
    raise ValueError(
        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
        f"[experts, {rows_cols[0]}, {rows_cols[1]}] or its last two dimensions swapped "
        "(does config.json match the weights?)"
    )
