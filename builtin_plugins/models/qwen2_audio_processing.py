"""Qwen2-Audio clips -> the model's inputs, as transformers' ``Qwen2AudioProcessor``.

Each clip (an audio item: :func:`chassis.core.audio_resampling.audio_waveform`, resampled
to the feature extractor's rate, 16 kHz) goes through the checkpoint's own feature extractor
(transformers' ``WhisperFeatureExtractor`` over ``preprocessor_config.json``; numpy and torch
only) as the HF processor calls it: ``padding="max_length"`` (every clip becomes 30 s of
frames; a longer clip is cut to its first 30 s) with the attention mask. The clip's frames
are the mask's sum, and its rows for the language model
:func:`~chassis.builtin_plugins.models.qwen2_audio_encoder.audio_token_count` of them (HF's
``num_audio_tokens``). The item's tensors are ``input_features`` ``[1, mel_bins, 3000]``
float32 and ``num_frames`` ``[1]`` int64.

Prompt: one ``<|AUDIO|>`` per clip (vLLM's convention; Qwen2-Audio's chat template writes
``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>``), expanded to the clip's rows (audio
embeddings: their row count, at most a 30 s clip's). No per-request processor kwargs are
taken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.qwen2_audio_encoder import AudioTowerSpec, audio_token_count
from chassis.core.audio_resampling import audio_waveform
from chassis.core.multimodal_embeds import PrecomputedItem
from chassis.core.multimodal_processing import MultiModalProcessor

#: ``Qwen2AudioProcessor``'s tokens (its defaults; the released tokenizers have them)
AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_BOS_TOKEN = "<|audio_bos|>"
AUDIO_EOS_TOKEN = "<|audio_eos|>"


class Qwen2AudioInputs(MultiModalProcessor):
    """Audio clips of Qwen2-Audio requests (module docstring). ``feature_extractor``:
    transformers' ``WhisperFeatureExtractor``; ``audio_token_id``: ``<|AUDIO|>``'s id."""

    def __init__(self, feature_extractor: Any, audio_token_id: int) -> None:
        self.feature_extractor = feature_extractor
        self.placeholder_token_ids = {"audio": int(audio_token_id)}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Qwen2AudioInputs:
        """The processor of the checkpoint in ``model_dir`` (its ``preprocessor_config.json``)
        for the model of ``hf_config`` (``audio_token_id``, ``audio_config``); ``ValueError``
        when something is missing or does not fit the tower."""
        from transformers import WhisperFeatureExtractor

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(
                f"the checkpoint {str(model_dir)!r} has no preprocessor_config.json: its "
                "feature extractor settings are unknown, so it cannot take audio"
            )
        kind = json.loads(path.read_text()).get("feature_extractor_type")
        if kind not in (None, "WhisperFeatureExtractor"):
            raise ValueError(
                f"feature extractor {kind!r} is not supported for Qwen2-Audio "
                "(WhisperFeatureExtractor)"
            )
        token_id = getattr(hf_config, "audio_token_id", None)
        if token_id is None:
            raise ValueError("the model's config lacks audio_token_index: it cannot take audio")
        extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        spec = AudioTowerSpec.from_config(getattr(hf_config, "audio_config", None))
        if int(extractor.feature_size) != spec.mel_bins:
            raise ValueError(
                f"the feature extractor makes {extractor.feature_size} mel bins, the audio "
                f"tower takes {spec.mel_bins} (audio_config.num_mel_bins)"
            )
        if int(extractor.nb_max_frames) != spec.num_frames:
            raise ValueError(
                f"the feature extractor pads clips to {extractor.nb_max_frames} frames, the "
                f"audio tower takes {spec.num_frames} (2 * max_source_positions)"
            )
        return cls(extractor, int(token_id))

    def prompt_placeholder(self, modality: str) -> str:
        return f"{AUDIO_BOS_TOKEN}{AUDIO_TOKEN}{AUDIO_EOS_TOKEN}"

    def precomputed_item(
        self, modality: str, item: PrecomputedItem
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Audio embeddings: a clip's rows, 1 to the rows of a 30 s clip (what the tower
        gives at most); ``ValueError`` for more."""
        most = audio_token_count(int(self.feature_extractor.nb_max_frames))
        if item.length > most:
            raise ValueError(
                f"audio embeddings have {item.length} rows; a clip has at most {most} (30 s)"
            )
        return item.length, item.tensors

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        rate = int(self.feature_extractor.sampling_rate)
        waveform = audio_waveform(item, rate)
        out = self.feature_extractor(
            waveform,
            sampling_rate=rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="np",
        )
        num_frames = int(out["attention_mask"].sum())
        length = audio_token_count(num_frames)
        if length < 1:
            raise ValueError(
                f"an audio clip of {waveform.size} samples at {rate} Hz is too short: it "
                "gives the model no row (send at least 0.02 s)"
            )
        features = torch.from_numpy(out["input_features"]).to(torch.float32)
        return length, {
            "input_features": features,
            "num_frames": torch.tensor([num_frames], dtype=torch.int64),
        }
