"""GLM-4.1V (``Glm4vForConditionalGeneration``) and GLM-4.5V
(``Glm4vMoeForConditionalGeneration``): the GLM-4 / GLM-4.5 language model, taking images.

Images go the Qwen2-VL way (:class:`~.qwen2_vl.QwenVLImages`): the vision tower
(:mod:`.glm4v_vision`) turns each image's patches into one row per ``<|image|>`` token of
its expanded run (:mod:`.glm4v_processing`), the runner puts the rows in place of those
tokens' embeddings, and image tokens get M-RoPE positions as transformers' ``get_rope_index``
gives them (for images the same rule as Qwen2-VL's, :mod:`.qwen2_vl_positions`). The tower
is whole on every tensor-parallel rank.

Videos (:mod:`.glm4v_media`): a video's feature covers its whole run, each temporal patch
group's ``<|image|>`` tokens between ``<|begin_of_image|>`` / ``<|end_of_image|>`` and its
timestamp; the tower runs on the video's patches one frame grid ``[1, h, w]`` per group (as
HF's ``get_video_features``) and its rows go to the run's ``<|image|>`` tokens, the token
embeddings elsewhere; each group is placed as an image of one frame and the tokens between
groups as text (HF's ``get_rope_index``).

The language model rotates q and k by M-RoPE: three position ids per token (temporal,
height, width); the rotary frequencies (``head_dim * partial_rotary_factor / 2`` of them) are
split into ``mrope_section`` groups, group ``i`` turned by position component ``i % 3``
(:class:`~chassis.core.layers.mrope.MRotaryEmbedding`), in the layout each text model has:

- GLM-4.1V duplicates each frequency in place (``repeat_interleave(2)``) and pairs dimension
  ``2i`` with ``2i + 1`` (``rotate_half_llm``): GLM-4-0414's interleaved partial RoPE, as
  :class:`~.glm4.Glm4ForCausalLM` applies it;
- GLM-4.5V concatenates the two halves (``cat([freq, freq])``) and rotates halves: GLM-4.5's
  rotate-half partial RoPE, as :class:`~.glm4_moe.Glm4MoeForCausalLM` applies it.

For text HF gives the three components the same value, so every frequency is turned by that
one position: that partial RoPE with the text config's ``rope_theta`` (the runner passes
``[T]`` positions then, ``[3, T]`` for a step with image tokens).
tests/test_more_multimodal_text_models.py checks both text tables against HF's rotary
modules; tests/test_glm4v_images.py the images, tests/test_glm4v_video.py the videos.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from chassis.builtin_plugins.models.glm4 import Glm4ForCausalLM
from chassis.builtin_plugins.models.glm4_moe import Glm4MoeForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel
from chassis.builtin_plugins.models.qwen2_vl import QwenVLImages
from chassis.builtin_plugins.models.text_only import wrapper_tie_word_embeddings
from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.layers.rotary import rope_parameters
from chassis.core.model_interface import ModelBuildContext
from chassis.core.multimodal import MultiModalFeature
from chassis.core.placeholder_runs import splice_item_rows

#: language model and LM head (transformers 5 and the hub files), then the older layout
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.visual.", "visual.")


class GlmVisionImages(QwenVLImages):
    """The GLM-V part of both classes (listed before the decoder class): GLM's tower and
    image and video processor, the decoder's rotary table taking M-RoPE positions, the LM
    head tied by the checkpoint's top-level ``tie_word_embeddings``."""

    language_model_prefixes = _LANGUAGE_MODEL_PREFIXES
    vision_prefixes = _VISION_PREFIXES
    supported_modalities = frozenset({"image", "video"})

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image and video processor (:mod:`.glm4v_media`)."""
        from chassis.builtin_plugins.models.glm4v_media import Glm4vMediaInputs

        return Glm4vMediaInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows as :class:`QwenVLImages`'; a video's, one per token of its run
        (``inputs["placeholder_ids"]``): the tower's rows of its frame groups (each group a
        ``[1, h, w]`` grid, as HF's ``get_video_features``) at the run's ``<|image|>``
        tokens, in order, and the token embeddings at its delimiters and timestamps."""
        if modality != "video":
            return super().embed_multimodal(modality, inputs)
        missing = [
            name
            for name in ("pixel_values_videos", "video_grid_thw", "placeholder_ids")
            if name not in inputs
        ]
        if missing:
            raise ValueError(f"video inputs lack {', '.join(missing)} (got {sorted(inputs)})")
        grid = inputs["video_grid_thw"].reshape(-1, 3)
        frames = torch.cat([torch.ones_like(grid[:, :1]), grid[:, 1:]], dim=1).repeat_interleave(
            grid[:, 0], dim=0
        )
        video_rows = self.image_rows(inputs["pixel_values_videos"], frames)
        run = inputs["placeholder_ids"]
        rows = self.embed_input_ids(run)
        return splice_item_rows(rows, run, self._image_token_id(), video_rows, "video")

    def position_items(
        self, feature: MultiModalFeature, grid: tuple[int, int, int]
    ) -> list[tuple[Any, ...]]:
        """HF's GLM-4.1V ``get_rope_index``: an image as Qwen2-VL's; each temporal patch
        group of a video as an image of one frame (its ``<|image|>`` tokens within the run;
        the delimiters and timestamps between them are text)."""
        if feature.modality != "video":
            return super().position_items(feature, grid)
        t, h, w = grid
        run = feature.data["placeholder_ids"].to_tensor().reshape(-1).numpy()
        groups = _runs_of(run == self._image_token_id())
        if len(groups) != t:
            raise ValueError(
                f"a video of {t} temporal patches has {len(groups)} runs of image tokens"
            )
        return [(feature.offset + start, length, (1, h, w)) for start, length in groups]

    def _image_token_id(self) -> int:
        return int(self.hf_config.image_token_id)  # type: ignore[attr-defined]

    def build_vision_tower(self, hf_config: Any) -> nn.Module:
        from chassis.builtin_plugins.models.glm4v_vision import Glm4vVisionTower

        cfg = getattr(hf_config, "vision_config", None)
        if cfg is None:
            raise ValueError(
                "the GLM-V config has no vision_config (is this the checkpoint's config.json, "
                "loaded with chassis.core.model_loader.load_hf_config?)"
            )
        return Glm4vVisionTower(cfg)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        return LlamaModel(
            hf_config,
            self.spec,  # type: ignore[attr-defined]
            build_ctx,
            self.make_layer,  # type: ignore[attr-defined]
            norm_class=self.norm_class,  # type: ignore[attr-defined]
            rotary_class=MRotaryEmbedding,
        )

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))  # type: ignore[misc]


class Glm4vForConditionalGeneration(GlmVisionImages, Glm4ForCausalLM):
    """``Glm4vForConditionalGeneration`` checkpoints (GLM-4.1V-9B-Thinking / Base), text,
    images and videos: GLM-4's decoder (the two extra norms per layer, the fused ``gate_up_proj``,
    interleaved partial RoPE) with the options HF's ``Glm4vTextAttention`` hard-codes:
    biases on q, k and v always (whatever ``attention_bias`` says), none on ``o_proj``,
    ``head_dim`` = ``hidden_size / num_attention_heads`` and RoPE over the whole head unless
    the config names a ``partial_rotary_factor`` (the released config.json says 0.5).

    Files name the language model ``model.language_model.*`` and ``lm_head.*`` (older ones
    ``language_model.model.*``, ``language_model.lm_head.*``) and the vision tower
    ``model.visual.*`` (or ``visual.*``), read whole on every rank. The LM head is tied by
    the checkpoint's top-level ``tie_word_embeddings``, as in transformers.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        rope = {**rope_parameters(hf_config), "interleaved": True}
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = 1.0  # HF's Glm4vTextRotaryEmbedding's default
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            mlp_bias=False,
            head_dim=int(hf_config.hidden_size) // int(hf_config.num_attention_heads),
            sliding_window=None,
            rope=rope,
        )


class Glm4vMoeForConditionalGeneration(GlmVisionImages, Glm4MoeForCausalLM):
    """``Glm4vMoeForConditionalGeneration`` checkpoints (GLM-4.5V), text, images and videos:
    GLM-4.5's decoder (rotate-half partial RoPE, default factor 0.5; q/k/v biases by
    ``attention_bias``; no q/k norms; DeepSeek-V3's sigmoid ``noaux_tc`` routing over the
    routed experts plus the shared ones after ``first_k_dense_replace`` dense layers).

    Names, the tower and the LM head's tying as GLM-4.1V.
    """


def _runs_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of true entries of the 1-D ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]
