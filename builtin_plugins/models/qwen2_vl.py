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

Images only: no video (``pixel_values_videos``), which the front-end refuses.
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


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    checkpoints (Qwen2's decoder: Q/K/V biases, ``head_dim`` = ``hidden_size /
    num_attention_heads`` as HF's attention computes it; the vision tower as ``visual``).

    Hub files name the language model ``model.*`` and ``lm_head.*`` beside the vision tower's
    ``visual.*`` (transformers 5 writes that layout too); its in-memory layout,
    ``model.language_model.*`` and ``model.visual.*``, is read too. The LM head is tied by
    the checkpoint's top-level ``tie_word_embeddings``, as in transformers.
    """

    supported_modalities = frozenset({"image"})
    uses_mrope = True

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.visual = vision_tower(hf_config)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)

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

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (``Qwen2VLImageInputs``, transformers'
        ``Qwen2VLImageProcessor`` underneath)."""
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
        return self.model(input_ids, positions, ctx, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows: ``inputs`` ``pixel_values [patches, C*T*P*P]`` and
        ``image_grid_thw [1, 3]`` -> ``[t * h * w / merge**2, hidden_size]`` (model dtype).
        ``ValueError`` for another modality, a missing input or mismatched shapes."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r} inputs")
        missing = [name for name in ("pixel_values", "image_grid_thw") if name not in inputs]
        if missing:
            raise ValueError(f"image inputs lack {', '.join(missing)} (got {sorted(inputs)})")
        return self.visual(inputs["pixel_values"], inputs["image_grid_thw"])

    def mrope_positions(
        self, prompt_token_ids: Sequence[int], features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        """HF's ``get_rope_index`` for the prompt's images (:mod:`.qwen2_vl_positions`)."""
        images = []
        for feature in features:
            if feature.modality != "image":
                raise ValueError(f"{type(self).__name__} takes images, not {feature.modality!r}")
            grid = feature.data["image_grid_thw"].to_tensor().reshape(-1, 3)
            if grid.shape[0] != 1:
                raise ValueError(f"a feature holds one image; image_grid_thw is {grid.tolist()}")
            t, h, w = (int(x) for x in grid[0])
            images.append((feature.offset, feature.length, (t, h, w)))
        return mrope_positions(len(prompt_token_ids), images, self.spatial_merge_size)

    # -- weights --------------------------------------------------------------------------------

    def needs_checkpoint_tensor(self, name: str) -> bool:
        if _vision_name(name) is not None:
            return True
        return super().needs_checkpoint_tensor(_language_name(name))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors (renamed to Qwen2's layout) to Qwen2's
        ``load_weights``; the tower's, whole on every rank, into ``visual``."""
        tower = dict(self.visual.named_parameters())
        filled: set[str] = set()

        def language_model() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = _vision_name(name)
                if ours is None:
                    yield _language_name(name), tensor
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

        return super().load_weights(language_model()) | filled

    def lora_module_aliases(self, hf_module: str) -> tuple[str, ...]:
        """transformers 5's name of a language-model projection
        (``model.language_model.layers.*``), which adapters trained on it use."""
        return checkpoint_aliases(hf_module, _LANGUAGE_PREFIXES)

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The language model's projections only: adapters never change the tower."""
        if module_name.startswith("visual."):
            return []
        return super().lora_slices(module_name, module)


def _vision_name(name: str) -> str | None:
    """Checkpoint name -> the tower's parameter name, or ``None`` for a non-tower tensor."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _language_name(name: str) -> str:
    """Checkpoint name -> Qwen2's name for it."""
    for prefix, ours in _LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name
