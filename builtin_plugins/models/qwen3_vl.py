"""Qwen3-VL and Qwen3-VL-MoE: a Qwen3 / Qwen3-MoE language model that takes images.

As Qwen2-VL (:mod:`.qwen2_vl`, whose :class:`~.qwen2_vl.QwenVLImages` this shares: the
image processor, the tower's weights, M-RoPE positions), with:

* **the tower** of :mod:`.qwen3_vl_vision` (learned position embeddings, deepstack
  mergers);
* **interleaved M-RoPE** (``mrope_interleaved``, :class:`~chassis.core.layers.mrope.
  MRotaryEmbedding`): frequency ``j`` is turned by the height component when ``j % 3 == 1``
  (within ``3 * mrope_section[1]``), by the width one when ``j % 3 == 2`` (within
  ``3 * mrope_section[2]``), else by the temporal one. Text tokens' three components are
  equal, which is ordinary RoPE (the runner passes ``[T]`` positions then). A prompt's
  positions are HF's Qwen3-VL ``get_rope_index``, which for images (one temporal patch
  group each) is Qwen2-VL's (:mod:`.qwen2_vl_positions`);
* **deepstack**: the tower also returns rows of some of its intermediate blocks (``K`` =
  ``len(deepstack_visual_indexes)`` sets), and the language model adds set ``k`` to the
  output of decoder layer ``k`` (the residual stream after the layer's MLP) at the image
  tokens' rows, as HF's ``Qwen3VLTextModel``.

How the deepstack rows travel: an image's rows are ``[length, hidden * (1 + K)]`` (the
merger's rows, then each deepstack set's, side by side: :meth:`Qwen3VLImages.image_rows`),
and :meth:`~Qwen3VLImages.embed_input_ids` returns rows as wide, the deepstack columns zero.
So the runner's ``inputs_embeds`` (token embeddings with the placeholder rows replaced by
the image's rows, also for a chunk that holds part of an image) carries each row's
deepstack inputs beside its embedding, and text rows add zeros. :class:`DeepstackDecoder`
splits them. A step without image tokens passes no ``inputs_embeds`` and has no deepstack
inputs.

Videos (:mod:`.qwen3_vl_media`): a video's feature covers its whole run, the timestamp and
``<|vision_start|>`` / ``<|vision_end|>`` tokens around each temporal patch group's
``<|video_pad|>`` tokens; its rows are the tower's (deepstack columns beside them) at the pad
tokens and the token embeddings elsewhere, and each group is placed as an image of one
frame, the tokens between groups as text (HF's ``get_rope_index`` for videos).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel, MakeLayer
from chassis.builtin_plugins.models.qwen2_vl import QwenVLImages
from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM
from chassis.builtin_plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from chassis.builtin_plugins.models.qwen3_vl_vision import Qwen3VisionTower, deepstack_blocks
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, qwen_moe_spec
from chassis.builtin_plugins.models.text_only import wrapper_tie_word_embeddings
from chassis.core.attention import ForwardContext
from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.multimodal import MultiModalFeature
from chassis.core.placeholder_runs import splice_item_rows

#: a Qwen3-VL-MoE layer's experts stored stacked: ``<block>.experts.gate_up_proj`` /
#: ``<block>.experts.down_proj`` (no ``.weight``), after the language-model rename
_STACKED_EXPERTS = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


#: HF's ``mrope_section`` for Qwen3-VL when the config names none (head_dim 128)
DEFAULT_MROPE_SECTION = (24, 20, 20)


class DeepstackDecoder(LlamaModel):
    """:class:`LlamaModel` whose ``inputs_embeds`` may carry ``num_deepstack`` more
    ``hidden_size`` columns: ``[T, hidden * (1 + num_deepstack)]``, the input embeddings
    then each deepstack set's rows. Set ``k`` is added to decoder layer ``k``'s output.

    ``inputs_embeds`` of width ``hidden_size`` (or none) is the plain forward. The deepstack
    path keeps no auxiliary hidden states (EAGLE-3 heads: speculative decoding is refused
    with images anyway).
    """

    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        build_ctx: ModelBuildContext,
        make_layer: MakeLayer,
        *,
        num_deepstack: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(hf_config, spec, build_ctx, make_layer, **kwargs)
        self.hidden_size = spec.hidden_size
        self.num_deepstack = num_deepstack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[-1] == hidden:
            return super().forward(input_ids, positions, ctx, inputs_embeds)
        if inputs_embeds.shape[-1] != hidden * (1 + self.num_deepstack):
            raise ValueError(
                f"inputs_embeds of width {inputs_embeds.shape[-1]}: expected {hidden} or, with "
                f"{self.num_deepstack} deepstack sets, {hidden * (1 + self.num_deepstack)}"
            )
        hidden_states = inputs_embeds[:, :hidden].contiguous()
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
            if i < self.num_deepstack:
                # the layer's output is hidden_states + residual: add set i to it (zeros on
                # text rows) through the residual stream
                first = hidden * (1 + i)
                residual = residual + inputs_embeds[:, first : first + hidden]
        if residual is None:  # a model with no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3VLImages(QwenVLImages):
    """Mixin (listed before the decoder class) of the Qwen3-VL classes: Qwen3-VL's tower,
    its deepstack rows beside the image rows, and the decoder with interleaved M-RoPE and
    deepstack inputs (:class:`DeepstackDecoder`).

    Files name the language model ``model.language_model.*`` and ``lm_head.*`` and the
    tower ``model.visual.*`` (``visual.*`` read too); the tower is loaded whole on every
    tensor-parallel rank. The LM head is tied by the checkpoint's top-level
    ``tie_word_embeddings``, as in transformers.
    """

    vision_prefixes = ("model.visual.", "visual.")
    supported_modalities = frozenset({"image", "video"})

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image and video processor (:mod:`.qwen3_vl_media`)."""
        from chassis.builtin_plugins.models.qwen3_vl_media import Qwen3VLMediaInputs

        return Qwen3VLMediaInputs.from_pretrained(model_dir, hf_config)

    #: image embeddings as vLLM's ``{"image_embeds", "image_grid_thw"}`` dict, each row
    #: the merger's then each deepstack set's side by side (:meth:`image_embeds_width`;
    #: core/multimodal_embeds.py)
    image_embeds_form = "grid"

    @classmethod
    def image_embeds_width(cls, hf_config: Any) -> int:
        """Image embeddings' width: ``hidden_size * (1 + K)``, as :meth:`image_rows` (and
        vLLM's Qwen3-VL) give them, ``K`` the tower's deepstack sets."""
        num_deepstack = len(deepstack_blocks(hf_config.vision_config))
        return int(hf_config.hidden_size) * (1 + num_deepstack)

    def build_vision_tower(self, hf_config: Any) -> nn.Module:
        cfg = getattr(hf_config, "vision_config", None)
        if cfg is None:
            raise ValueError(
                "the Qwen3-VL config has no vision_config (is this the checkpoint's "
                "config.json, loaded with chassis.core.model_loader.load_hf_config?)"
            )
        return Qwen3VisionTower(cfg)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        rope = dict(self.spec.rope)  # type: ignore[attr-defined]
        # HF's Qwen3-VL rotary is interleaved whatever the config says
        rope["mrope_interleaved"] = True
        rope["mrope_section"] = rope.get("mrope_section") or list(DEFAULT_MROPE_SECTION)
        return DeepstackDecoder(
            hf_config,
            self.spec,  # type: ignore[attr-defined]
            build_ctx,
            self.make_layer,  # type: ignore[attr-defined]
            norm_class=self.norm_class,  # type: ignore[attr-defined]
            rope_per_layer=[rope] * int(hf_config.num_hidden_layers),
            rotary_class=MRotaryEmbedding,
            num_deepstack=len(deepstack_blocks(hf_config.vision_config)),
        )

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))  # type: ignore[misc]

    def image_rows(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden * (1 + K)]``: the merger's rows, then each deepstack set's."""
        rows, deepstack = self.visual(pixel_values, grid_thw)
        return torch.cat([rows, *deepstack], dim=-1) if deepstack else rows

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows as :class:`QwenVLImages`'; a video's, one per token of its run
        (``inputs["placeholder_ids"]``, :mod:`.qwen3_vl_media`): the tower's rows (with
        their deepstack columns) at its ``<|video_pad|>`` tokens, in order, and
        :meth:`embed_input_ids`' rows at its timestamp and frame-delimiting tokens."""
        if modality != "video":
            return super().embed_multimodal(modality, inputs)
        run = inputs.get("placeholder_ids")
        if run is None:
            raise ValueError(f"video inputs lack placeholder_ids (got {sorted(inputs)})")
        video_rows = super().embed_multimodal(modality, inputs)
        rows = self.embed_input_ids(run)
        return splice_item_rows(rows, run, self._video_token_id(), video_rows, "video")

    def position_items(
        self, feature: MultiModalFeature, grid: tuple[int, int, int]
    ) -> list[tuple[Any, ...]]:
        """HF's Qwen3-VL ``get_rope_index``: an image as Qwen2-VL's; each temporal patch
        group of a video as an image of one frame (its pad tokens within the run; the
        timestamps and delimiters between them are text)."""
        if feature.modality != "video":
            return super().position_items(feature, grid)
        t, h, w = grid
        run = feature.data["placeholder_ids"].to_tensor().reshape(-1).numpy()
        groups = _runs_of(run == self._video_token_id())
        if len(groups) != t:
            raise ValueError(
                f"a video of {t} temporal patches has {len(groups)} runs of video tokens"
            )
        return [(feature.offset + start, length, (1, h, w)) for start, length in groups]

    def _video_token_id(self) -> int:
        token = getattr(self.hf_config, "video_token_id", None)  # type: ignore[attr-defined]
        if token is None:
            raise ValueError("the model's config lacks video_token_id: it cannot take videos")
        return int(token)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[n, hidden]`` and, when the tower has deepstack sets, ``K *
        hidden`` zero columns after them (as wide as :meth:`image_rows`' rows)."""
        embeds = self.model.embed(input_ids)  # type: ignore[attr-defined]
        extra = self.model.num_deepstack * embeds.shape[-1]  # type: ignore[attr-defined]
        if not extra:
            return embeds
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], extra)], dim=-1)


class Qwen3VLForConditionalGeneration(Qwen3VLImages, Qwen3ForCausalLM):
    """``Qwen3VLForConditionalGeneration`` checkpoints (Qwen3's decoder: RMSNorm on each q/k
    head, ``head_dim`` from the config, ``attention_bias`` on all four projections, no
    sliding window; Qwen3-VL's tower as ``visual``)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qk_norm=True, sliding_window=None)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLImages, Qwen3MoeForCausalLM):
    """``Qwen3VLMoeForConditionalGeneration`` checkpoints (Qwen3-VL-30B-A3B,
    Qwen3-VL-235B-A22B): Qwen3-MoE's decoder, whose router always renormalizes its top-k
    weights (HF's ``Qwen3VLMoeTextTopKRouter`` does, whatever ``norm_topk_prob`` says), and
    Qwen3-VL's tower.

    Names as Qwen3-VL. Each sparse layer's experts come stacked: ``experts.gate_up_proj``
    (hub files ``[experts, hidden, 2 * moe_intermediate]``, gate columns first) and
    ``experts.down_proj`` (``[experts, moe_intermediate, hidden]``); transformers 5 writes
    them in its in-memory layout (the last two dimensions swapped), which is read too,
    telling the two apart by shape as transformers does. The LM head is tied by the
    checkpoint's top-level ``tie_word_embeddings`` (the text config's class defaults its own
    to true; the released config.json sets the top-level one false).
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qk_norm=True, sliding_window=None)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return dataclasses.replace(qwen_moe_spec(hf_config, shared_expert=False), renormalize=True)

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


def _runs_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of true entries of the 1-D ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


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
