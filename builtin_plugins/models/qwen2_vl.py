"""Qwen2-VL and Qwen2.5-VL: a Qwen2 language model that takes images.

The vision tower (:mod:`.qwen2_vl_vision` for Qwen2-VL, :mod:`.qwen2_5_vl_vision` for
Qwen2.5-VL, picked by the checkpoint's ``vision_config``) turns one image's patches into one
row per placeholder token (:meth:`Qwen2VLForConditionalGeneration.embed_multimodal`); the
runner puts those rows in place of the placeholder tokens' embeddings and passes the result
as ``inputs_embeds``. The tower runs in the model's dtype and is whole on every
tensor-parallel rank (the language model is sharded as Qwen2's).

The language model rotates q and k by M-RoPE: three position components per token
(temporal, height, width; :mod:`.qwen2_vl_positions`), the rotary frequencies split into
``mrope_section`` groups (:class:`~chassis.core.layers.mrope.MRotaryEmbedding`). For text
the three components are equal and the rotation is plain RoPE with the text config's
``rope_theta``: the runner passes ``[T]`` positions then, and ``[3, T]`` for a step with
image tokens.

Videos (Qwen2-VL and Qwen2.5-VL; Qwen3-VL's in :mod:`.qwen3_vl`): the caller's frames
(:mod:`.qwen2_vl_media`) go through the same tower (``pixel_values_videos``,
``video_grid_thw``; Qwen2.5-VL's windows per frame grid); a video's temporal positions step
by 1 per temporal patch (Qwen2-VL) or by ``tokens_per_second * second_per_grid_t``
(Qwen2.5-VL), as transformers' ``get_rope_index``.

:class:`QwenVLImages` is the part shared with Qwen3-VL (:mod:`.qwen3_vl`): the tower's
weights and inputs, the image processor and the M-RoPE positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM, qwen2_sliding_layers
from chassis.builtin_plugins.models.qwen2_vl_positions import mrope_positions
from chassis.builtin_plugins.models.text_only import checkpoint_aliases, wrapper_tie_word_embeddings
from chassis.core.attention import ForwardContext
from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.model_interface import LoRASlice, ModelBuildContext
from chassis.core.multimodal import MultiModalFeature

#: checkpoint-name prefixes of the vision tower (hub files; transformers 5's in-memory layout)
_VISION_PREFIXES = ("visual.", "model.visual.")
#: (checkpoint-name prefix, ours) of the language model, the first that matches applies
_LANGUAGE_PREFIXES = (("model.language_model.", "model."),)
#: modality -> the names of its (patches, grid) inputs
_INPUT_NAMES = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


def vision_tower(hf_config: Any) -> nn.Module:
    """The tower of the config's ``vision_config`` (kept on the text config by
    :func:`~chassis.core.model_loader.language_model_config`): Qwen2-VL's or Qwen2.5-VL's
    by its ``model_type``."""
    cfg = getattr(hf_config, "vision_config", None)
    if cfg is None:
        raise ValueError(
            "the Qwen2-VL config has no vision_config (is this the checkpoint's config.json, "
            "loaded with chassis.core.model_loader.load_hf_config?)"
        )
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type.startswith("qwen2_5_vl"):
        from chassis.builtin_plugins.models.qwen2_5_vl_vision import Qwen2_5VisionTower

        return Qwen2_5VisionTower(cfg)
    if model_type.startswith("qwen2_vl"):
        from chassis.builtin_plugins.models.qwen2_vl_vision import Qwen2VisionTower

        return Qwen2VisionTower(cfg)
    raise ValueError(f"vision_config model_type {model_type!r} is not Qwen2-VL's or Qwen2.5-VL's")


class QwenVLImages:
    """Mixin (listed before the decoder class) of the Qwen VL classes that take images:
    the vision tower as ``visual``, the image inputs, M-RoPE positions and the checkpoint
    names; the decoder class it is mixed into (a
    :class:`~chassis.builtin_plugins.models.llama.LlamaForCausalLM`) supplies the language
    model, whose ``build_decoder`` the subclass points at an M-RoPE rotary table.

    Checkpoint names: the tower's tensors under :attr:`vision_prefixes`, loaded whole on
    every tensor-parallel rank; the language model's under the decoder class's names or
    :attr:`language_model_prefixes` (renamed to them). A subclass implements
    :meth:`build_vision_tower` and, when the tower's output is not one tensor of rows,
    :meth:`image_rows`.
    """

    supported_modalities = frozenset({"image"})
    uses_mrope = True
    #: checkpoint-name prefixes of the vision tower (hub files; transformers 5's in-memory
    #: layout)
    vision_prefixes: tuple[str, ...] = _VISION_PREFIXES
    #: (checkpoint-name prefix, ours) of the language model, the first that matches applies
    language_model_prefixes: tuple[tuple[str, str], ...] = _LANGUAGE_PREFIXES

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)  # type: ignore[call-arg]
        self.visual = self.build_vision_tower(hf_config)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.hf_config_vision = hf_config.vision_config

    def build_vision_tower(self, hf_config: Any) -> nn.Module:
        """The vision tower of ``hf_config.vision_config`` (parameter names: the
        checkpoint's, :attr:`vision_prefixes` stripped)."""
        raise NotImplementedError

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (``Qwen2VLImageInputs``, transformers'
        ``Qwen2VLImageProcessor`` underneath, configured by the checkpoint's
        ``preprocessor_config.json``)."""
        from chassis.builtin_plugins.models.qwen2_vl_processing import Qwen2VLImageInputs

        return Qwen2VLImageInputs.from_pretrained(model_dir, hf_config)

    # -- inputs ---------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`CausalLM.forward`; ``positions`` ``[T]`` or ``[3, T]`` (M-RoPE)."""
        decoder = self.model  # type: ignore[attr-defined]
        return decoder(input_ids, positions, ctx, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)  # type: ignore[attr-defined]

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows: ``inputs`` ``pixel_values [patches, C*T*P*P]`` and
        ``image_grid_thw [1, 3]`` -> :meth:`image_rows`, ``t * h * w / merge**2`` rows (model
        dtype); a video's (a class whose :attr:`supported_modalities` has ``"video"``) from
        ``pixel_values_videos`` and ``video_grid_thw`` through the same tower. ``ValueError``
        for another modality, a missing input or mismatched shapes."""
        if modality not in self.supported_modalities or modality not in _INPUT_NAMES:
            raise ValueError(
                f"{type(self).__name__} takes "
                f"{' and '.join(m + 's' for m in sorted(self.supported_modalities))}, "
                f"not {modality!r} inputs"
            )
        pixels, grid = _INPUT_NAMES[modality]
        missing = [name for name in (pixels, grid) if name not in inputs]
        if missing:
            raise ValueError(f"{modality} inputs lack {', '.join(missing)} (got {sorted(inputs)})")
        return self.image_rows(inputs[pixels], inputs[grid])

    def image_rows(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The tower's rows for ``pixel_values`` of images ``grid_thw``: ``[rows,
        hidden_size]`` (what :meth:`embed_multimodal` returns)."""
        return self.visual(pixel_values, grid_thw)

    def mrope_positions(
        self, prompt_token_ids: Sequence[int], features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        """HF's ``get_rope_index`` for the prompt's images and videos
        (:mod:`.qwen2_vl_positions`; a video's temporal interval from
        :meth:`video_time_interval`)."""
        items: list[Any] = []
        for feature in features:
            if feature.modality not in self.supported_modalities:
                raise ValueError(f"{type(self).__name__} does not take {feature.modality!r}")
            grid_name = _INPUT_NAMES[feature.modality][1]
            grid = feature.data[grid_name].to_tensor().reshape(-1, 3)
            if grid.shape[0] != 1:
                raise ValueError(f"a feature holds one item; {grid_name} is {grid.tolist()}")
            t, h, w = (int(x) for x in grid[0])
            items += self.position_items(feature, (t, h, w))
        return mrope_positions(len(prompt_token_ids), items, self.spatial_merge_size)

    def position_items(
        self, feature: MultiModalFeature, grid: tuple[int, int, int]
    ) -> list[tuple[Any, ...]]:
        """The :func:`.qwen2_vl_positions.mrope_positions` items of one feature of grid
        ``(t, h, w)``: the feature itself, with :meth:`video_time_interval` for a video."""
        item: tuple[Any, ...] = (feature.offset, feature.length, grid)
        if feature.modality == "video":
            item += (self.video_time_interval(feature),)
        return [item]

    def video_time_interval(self, feature: MultiModalFeature) -> float:
        """The temporal position step of a video (module docstring): 1 for Qwen2-VL;
        Qwen2.5-VL's ``tokens_per_second * second_per_grid_t`` (float32, as transformers)."""
        vision = self.hf_config_vision  # type: ignore[attr-defined]
        tokens_per_second = getattr(vision, "tokens_per_second", None)
        if not str(getattr(vision, "model_type", "")).startswith("qwen2_5_vl"):
            return 1.0
        seconds = feature.data["second_per_grid_t"].to_tensor().reshape(-1)
        return float(np.float32(tokens_per_second) * seconds[0].numpy().astype(np.float32))

    # -- weights --------------------------------------------------------------------------------

    def vision_name(self, name: str) -> str | None:
        """Checkpoint name -> the tower's parameter name, or ``None`` for a non-tower tensor."""
        for prefix in self.vision_prefixes:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return None

    def language_model_name(self, name: str) -> str:
        """Checkpoint name -> the decoder class's name for it."""
        for prefix, ours in self.language_model_prefixes:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name

    def needs_checkpoint_tensor(self, name: str) -> bool:
        if self.vision_name(name) is not None:
            return True
        return super().needs_checkpoint_tensor(self.language_model_name(name))  # type: ignore[misc]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors (renamed) to the decoder class's ``load_weights``;
        the tower's, whole on every rank, into ``visual``."""
        tower = dict(self.visual.named_parameters())
        filled: set[str] = set()

        def language_model() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = self.vision_name(name)
                if ours is None:
                    yield self.language_model_name(name), tensor
                    continue
                param = tower.get(ours)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in the vision tower; "
                        "is the checkpoint's architecture right?"
                    )
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(param.shape)} (does config.json match the weights?)"
                    )
                param.copy_(tensor)
                filled.add(f"visual.{ours}")

        return super().load_weights(language_model()) | filled  # type: ignore[misc]

    def lora_module_aliases(self, hf_module: str) -> tuple[str, ...]:
        """transformers 5's name of a language-model projection
        (``model.language_model.layers.*``), which adapters trained on it use."""
        return checkpoint_aliases(hf_module, self.language_model_prefixes)

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The language model's projections only: adapters never change the tower."""
        if module_name.startswith("visual."):
            return []
        return super().lora_slices(module_name, module)  # type: ignore[misc]


class Qwen2VLForConditionalGeneration(QwenVLImages, Qwen2ForCausalLM):
    """``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    checkpoints (Qwen2's decoder: Q/K/V biases, ``head_dim`` = ``hidden_size /
    num_attention_heads`` as HF's attention computes it; the vision tower as ``visual``).

    Hub files name the language model ``model.*`` and ``lm_head.*`` beside the vision tower's
    ``visual.*`` (transformers 5 writes that layout too); its in-memory layout,
    ``model.language_model.*`` and ``model.visual.*``, is read too. The LM head is tied by
    the checkpoint's top-level ``tie_word_embeddings``, as in transformers.
    """

    supported_modalities = frozenset({"image", "video"})
    #: image embeddings taken as vLLM's ``{"image_embeds", "image_grid_thw"}`` dict
    #: (core/multimodal_embeds.py)
    image_embeds_form = "grid"

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image and video processor (:mod:`.qwen2_vl_media`)."""
        from chassis.builtin_plugins.models.qwen2_vl_media import Qwen2VLMediaInputs

        return Qwen2VLMediaInputs.from_pretrained(model_dir, hf_config)

    def build_vision_tower(self, hf_config: Any) -> nn.Module:
        return vision_tower(hf_config)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            head_dim=int(hf_config.hidden_size) // int(hf_config.num_attention_heads),
            sliding_layers=qwen2_sliding_layers(hf_config),
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        return LlamaModel(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            norm_class=self.norm_class,
            rotary_class=MRotaryEmbedding,
        )

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))
