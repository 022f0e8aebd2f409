"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) with audio: the text config's decoder
(Qwen2), a Whisper-style audio tower and a linear projector.

The class is composed over the registered decoder of the text architecture as LLaVA's is
(:mod:`.llava`: the language model's tensors renamed to it; positions are the decoder's own,
1-D; the LM head never tied to the embeddings, as transformers' class ties none), and builds the audio tower and projector (:mod:`.qwen2_audio_encoder`) whole on every
tensor-parallel rank, reading ``audio_tower.*`` and ``multi_modal_projector.*`` (hub files)
or ``model.audio_tower.*`` and ``model.multi_modal_projector.*`` (transformers 5's layout).
Each clip becomes its rows of the language model's width
(:meth:`Qwen2AudioForConditionalGenerationWithAudio.embed_multimodal`), which the runner
puts in place of the clip's ``<|AUDIO|>`` tokens; with ``--enable-mm-embeds`` a caller may
send those rows instead of the clip (``audio_embeds``), and the tower does not run. LoRA
adapters change the language model only.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.embeds_forward import DecoderOverEmbeds
from chassis.builtin_plugins.models.image_side_weights import ImageSideWeights, renamed_by_prefix
from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.qwen2_audio_encoder import (
    AudioTowerSpec,
    Qwen2AudioProjector,
    Qwen2AudioTower,
    audio_token_count,
)
from chassis.core.model_interface import ModelBuildContext

#: (checkpoint-name prefix, ours) of the audio side, the first that matches applies
_AUDIO_PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def audio_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an audio-side tensor, ``None`` for the language model's."""
    return renamed_by_prefix(name, _AUDIO_PREFIXES)


class Qwen2AudioForConditionalGenerationWithAudio(
    ImageSideWeights, DecoderOverEmbeds, LlavaForConditionalGeneration
):
    """``Qwen2AudioForConditionalGeneration`` checkpoints with audio (module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder.
    """

    supported_modalities = frozenset({"audio"})
    #: audio embeddings (vLLM's ``audio_embeds``) as ``[rows, hidden]`` tensors, the
    #: projector's rows of a clip (core/multimodal_embeds.py)
    audio_embeds_form = "rows"
    image_modules = ("audio_tower.", "multi_modal_projector.")
    image_side_label = "Qwen2-Audio audio tower or projector"
    image_side_name = staticmethod(audio_side_name)
    vision_prefixes = (
        "audio_tower.",
        "multi_modal_projector.",
        "model.audio_tower.",
        "model.multi_modal_projector.",
    )

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.check_decoder_takes_embeds("audio needs")
        self.audio_spec = AudioTowerSpec.from_config(getattr(hf_config, "audio_config", None))
        self.audio_tower = Qwen2AudioTower(self.audio_spec)
        self.multi_modal_projector = Qwen2AudioProjector(
            self.audio_spec.d_model, int(hf_config.hidden_size)
        )

    def build_head(self, hf_config: Any) -> None:
        # transformers' Qwen2-Audio class ties no weights, whatever either config says: the
        # LM head is always the checkpoint's own
        config = copy.copy(hf_config)
        config.tie_word_embeddings = False
        super(LlavaForConditionalGeneration, self).build_head(config)  # type: ignore[misc]

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's audio processor (:class:`~.qwen2_audio_processing.Qwen2AudioInputs`)."""
        from chassis.builtin_plugins.models.qwen2_audio_processing import Qwen2AudioInputs

        return Qwen2AudioInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One clip's rows: ``inputs["input_features"]`` ``[1, mel_bins, 3000]`` and
        ``inputs["num_frames"]`` ``[1]`` -> ``[audio_token_count(num_frames), hidden_size]``
        in the model's dtype. ``ValueError`` for another modality or missing inputs."""
        if modality != "audio":
            raise ValueError(f"{type(self).__name__} takes audio, not {modality!r} inputs")
        features, frames = inputs.get("input_features"), inputs.get("num_frames")
        if features is None or frames is None:
            raise ValueError(
                f"audio inputs need input_features and num_frames (got {sorted(inputs)})"
            )
        if features.dim() == 2:
            features = features[None]
        if features.shape[0] != 1 or frames.numel() != 1:
            raise ValueError(f"a feature holds one clip; input_features is {tuple(features.shape)}")
        rows = self.audio_features(features, frames.reshape(1))
        return rows[0, : audio_token_count(int(frames.reshape(-1)[0]))]

    def audio_features(self, features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """``[clips, mel_bins, 3000]`` and each clip's frame count -> ``[clips,
        max_source_positions // 2, hidden_size]`` (the tower's rows projected; a clip's
        first ``audio_token_count`` rows are its own)."""
        return self.multi_modal_projector(self.audio_tower(features, num_frames))
