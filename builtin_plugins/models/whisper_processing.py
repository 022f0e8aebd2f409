"""Whisper clips -> the encoder's inputs, as transformers' ``WhisperProcessor`` makes them.

A Whisper request is a decoder prompt (``<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>``: the tokens HF's ``generate`` forces) and exactly one ``"audio"`` item,
which takes no prompt position: the prompt holds no placeholder and is kept as it is. The
clip (:func:`chassis.core.audio_resampling.audio_waveform`, resampled to 16 kHz) goes through
the checkpoint's ``WhisperFeatureExtractor`` (``preprocessor_config.json``), padded to the
30 s window: ``input_features`` ``[1, mel_bins, 3000]`` float32. A clip longer than the window
is refused (``ValueError``); the transcription endpoint splits long files into windows first
(:mod:`chassis.serve.openai_transcriptions`).

The item's feature is recorded at prompt offset 0 with length 1 (a feature needs a range);
the runner hands it to the encoder (``CausalLM.is_encoder_decoder``), never as embeddings.
The front-end calls :meth:`WhisperInputs.process` for every request, with or without items
(:meth:`~chassis.core.multimodal_inputs.MultiModalInputs.is_encoder_decoder`): a request
without its clip is refused here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.qwen2_audio_encoder import AudioTowerSpec
from chassis.core.audio_resampling import audio_waveform
from chassis.core.multimodal import MultiModalFeature, make_feature
from chassis.core.multimodal_embeds import PrecomputedItem
from chassis.core.multimodal_processing import MultiModalProcessor


class WhisperInputs(MultiModalProcessor):
    """One audio clip per Whisper request (module docstring). ``feature_extractor``:
    transformers' ``WhisperFeatureExtractor``."""

    #: no placeholder token: the clip takes no decoder position
    placeholder_token_ids: Mapping[str, int] = {}

    def __init__(self, feature_extractor: Any) -> None:
        self.feature_extractor = feature_extractor

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> WhisperInputs:
        """The processor of the checkpoint in ``model_dir``; ``ValueError`` when its
        ``preprocessor_config.json`` is missing or does not fit the encoder."""
        from transformers import WhisperFeatureExtractor

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(
                f"the Whisper checkpoint {str(model_dir)!r} has no preprocessor_config.json: "
                "its feature extractor settings are unknown"
            )
        kind = json.loads(path.read_text()).get("feature_extractor_type")
        if kind not in (None, "WhisperFeatureExtractor"):
            raise ValueError(f"feature extractor {kind!r} is not Whisper's")
        extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        spec = AudioTowerSpec.from_config(hf_config)
        if (int(extractor.feature_size), int(extractor.nb_max_frames)) != (
            spec.mel_bins,
            spec.num_frames,
        ):
            raise ValueError(
                f"the feature extractor makes {extractor.feature_size} mel bins x "
                f"{extractor.nb_max_frames} frames; the encoder takes {spec.mel_bins} x "
                f"{spec.num_frames}"
            )
        return cls(extractor)

    @property
    def sampling_rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    @property
    def window_samples(self) -> int:
        """Samples of one 30 s window at :attr:`sampling_rate`."""
        return int(self.feature_extractor.n_samples)

    def prompt_placeholder(self, modality: str) -> str:
        return ""  # (the clip takes no prompt position)

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt unchanged and the clip's feature; ``ValueError`` unless ``items`` is
        exactly one audio clip and the prompt is not empty."""
        kwargs = dict(kwargs or {})
        self.check_kwargs(kwargs)
        other = sorted(m for m, values in items.items() if m != "audio" and values)
        clips = list(items.get("audio", ()))
        if not other and not clips:  # (its encoder would read nothing: refused)
            raise ValueError(
                "a Whisper request needs its audio clip: send one in "
                "multi_modal_data={'audio': (waveform, sampling_rate)}"
            )
        if other or len(clips) != 1:
            raise ValueError(
                "a Whisper request takes exactly one audio clip and no other item; got "
                f"{len(clips)} audio clip(s)" + (f" and {', '.join(other)}" if other else "")
            )
        if not prompt_token_ids:
            raise ValueError(
                "a Whisper request needs a decoder prompt, e.g. "
                "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
            )
        if isinstance(clips[0], PrecomputedItem):
            raise ValueError("Whisper does not take audio embeddings; send the clip")
        _, tensors = self._process_one("audio", clips[0], kwargs)
        return list(prompt_token_ids), [make_feature("audio", 0, 1, tensors)]

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        rate = self.sampling_rate
        waveform = audio_waveform(item, rate)
        if waveform.size > self.window_samples:
            raise ValueError(
                f"an audio clip of {waveform.size / rate:.1f} s is longer than Whisper's "
                f"{self.window_samples // rate} s window; split it (the transcription "
                "endpoint does)"
            )
        out = self.feature_extractor(waveform, sampling_rate=rate, return_tensors="np")
        features = torch.from_numpy(out["input_features"]).to(torch.float32)
        return 1, {"input_features": features}
