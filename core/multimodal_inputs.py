"""A request's multimodal items in the front-end: admission, then the model's processor.

:class:`MultiModalInputs` belongs to the :class:`~chassis.core.input_processor.InputProcessor`
of one engine. :meth:`~MultiModalInputs.check_counts` says whether the engine takes a prompt
with so many items of each modality (cheap; the chat front-ends ask it before they fetch a
message's images); :meth:`~MultiModalInputs.expand` runs vLLM's ``multi_modal_data`` through
the model's processor (:mod:`chassis.core.multimodal_processing`), which is built on the
first request that carries items, once: the model's class (its ``class_for_config``) gives
it from the checkpoint folder (``multimodal_processor(model_dir, hf_config)``). A model
that takes text only never builds one, and refuses items naming the model.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from chassis.core.multimodal_admission import engine_mode_refusal
from chassis.core.multimodal_embeds import flag_refusal, is_embeds_item, precomputed_items
from chassis.core.multimodal_item_cache import ProcessedItemCache
from chassis.core.multimodal_limits import check_item_count, parse_limits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.core.config import EngineConfig
    from chassis.core.multimodal import MultiModalFeature
    from chassis.core.multimodal_processing import MultiModalProcessor

#: the modalities ``multi_modal_data`` may name (vLLM's); the models here take images,
#: Qwen2-VL / Qwen2.5-VL / Qwen3-VL videos and Qwen2-Audio's audio
MULTIMODAL_INPUT_MODALITIES = ("image", "video", "audio")


class ModalityRefusedError(ValueError):
    """The engine's model does not take a modality at all (a text-only model's images)."""


class MultiModalInputs:
    """Admission and processing of one engine's multimodal items (module docstring).

    ``config`` must be finalized (``config.model`` a local folder); ``tokenizer`` is the
    engine's (``None`` with ``skip_tokenizer_init``: items are refused). Thread-safe.
    """

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        #: ``--limit-mm-per-prompt``, parsed once (the config validated it)
        self._limits = parse_limits(config.limit_mm_per_prompt)
        self._processor: MultiModalProcessor | None = None
        self._lock = threading.Lock()
        #: the model's class and HF config, read on first need (a request with items)
        self._model_cls: Any = None
        self._hf_config: Any = None
        #: processed items kept for requests that send them again (--mm-processor-cache-gb;
        #: None: disabled), handed to the processor when it is built
        self.item_cache = ProcessedItemCache.from_gb(config.mm_processor_cache_gb)
        if config.mm_processor_kwargs and tokenizer is not None:
            self._check_default_kwargs(config.mm_processor_kwargs)

    def _check_default_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """``--mm-processor-kwargs`` checked by the model's processor, built now (a bad key
        fails the start, with a request's message); a text-only model ignores them."""
        if not self.supported_modalities():
            return
        try:
            self.processor().check_kwargs(dict(kwargs))
        except ValueError as exc:
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None

    def check_counts(self, counts: Mapping[str, int]) -> None:
        """Whether this engine takes a prompt with ``counts`` items per modality
        (``{"image": 2}``; a count of 0 is no item): a ``ValueError`` for an unknown
        modality, an engine without a tokenizer, a model that does not take the modality
        (:class:`ModalityRefusedError` naming it: a text-only one "takes text only"), or a
        count over
        ``--limit-mm-per-prompt`` (vLLM's message), or an engine that serves no items
        (speculative decoding, a pooling runner: ``engine_mode_refusal``). The model's
        processor is not built."""
        for modality, count in counts.items():
            if count <= 0:
                continue
            if modality not in MULTIMODAL_INPUT_MODALITIES:
                raise ValueError(
                    f"unknown modality {modality!r} in multi_modal_data; known: "
                    f"{', '.join(MULTIMODAL_INPUT_MODALITIES)}"
                )
            if self.tokenizer is None:
                raise ValueError(
                    f"{modality} inputs need the model's tokenizer, and this engine runs "
                    "without one (skip_tokenizer_init)"
                )
            cls = self._model_class()
            supported = getattr(cls, "supported_modalities", frozenset())
            if modality not in supported:
                what = (
                    "takes text only"
                    if not supported
                    else f"takes {', '.join(sorted(supported))} inputs, not {modality}"
                )
                name = self.config.served_model_name or self.config.model
                raise ModalityRefusedError(
                    f"model {name!r} ({cls.__name__}) {what}; it cannot take {modality} inputs"
                )
            check_item_count(self._limits, modality, count)
        # (the engine core refuses these too; asking here fails the call before any image
        # is fetched or processed, and LLM.generate raises instead of returning an error)
        refusal = engine_mode_refusal(self.config, [m for m, n in counts.items() if n > 0])
        if refusal is not None:
            raise ValueError(refusal)

    def is_encoder_decoder(self) -> bool:
        """Whether the engine's model is an encoder-decoder (Whisper,
        ``CausalLM.is_encoder_decoder``): its every request needs its item (the clip its
        encoder reads), and text prompts are tokenized without special tokens (vLLM's rule:
        the decoder prompt names them). ``False`` for a config that names no model (unit
        tests of the front-end); the model's class is read once."""
        if self.config.model is None:
            return False
        return bool(getattr(self._model_class(), "is_encoder_decoder", False))

    def supported_modalities(self) -> frozenset[str]:
        """The modalities the engine's model takes (empty: text only); the model's class is
        read on the first call, its processor is not built."""
        return frozenset(getattr(self._model_class(), "supported_modalities", frozenset()))

    def processor(self) -> MultiModalProcessor:
        """The model's multimodal processor, built once on first need; ``ValueError`` when
        the model has none, or when the tokenizer does not encode the model's placeholder
        to its token (a ``--tokenizer`` other than the model's)."""
        with self._lock:
            if self._processor is None:
                self._processor = self._build_processor()
            return self._processor

    def expand(
        self,
        prompt_token_ids: list[int],
        multi_modal_data: Mapping[str, Any],
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each item's placeholder expanded, and one feature per item in
        prompt order (:meth:`MultiModalProcessor.process`), once :meth:`check_counts`
        passed. ``multi_modal_data`` is vLLM's (:func:`multimodal_items`); when it holds no
        item at all the prompt is returned as it is (an encoder-decoder model's processor
        sees it, and refuses it: :meth:`is_encoder_decoder`). Image embeddings among the images
        (tensors, Qwen2-VL's dict) and audio embeddings among the clips (tensors of 2 or 3
        dimensions) need ``enable_mm_embeds`` and skip the model's processing
        (:mod:`chassis.core.multimodal_embeds`)."""
        items = multimodal_items(multi_modal_data)
        if not any(items.values()):
            if self.is_encoder_decoder():  # (its processor refuses a request without a clip)
                return self.processor().process(prompt_token_ids, {}, mm_processor_kwargs)
            return prompt_token_ids, []
        self.check_counts({modality: len(values) for modality, values in items.items()})
        if any(
            is_embeds_item(item, modality) for modality, values in items.items() for item in values
        ):
            items = self._precomputed(items)
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, Mapping):
            raise ValueError(
                f"mm_processor_kwargs must be a dict; got {type(mm_processor_kwargs).__name__}"
            )
        if self.config.mm_processor_kwargs:  # (--mm-processor-kwargs: the request's win)
            mm_processor_kwargs = {**self.config.mm_processor_kwargs, **(mm_processor_kwargs or {})}
        return self.processor().process(
            prompt_token_ids,
            {modality: values for modality, values in items.items() if values},
            mm_processor_kwargs,
        )

    def _precomputed(self, items: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """``items`` with image (audio) embeddings as their images' (clips') precomputed
        rows (:func:`~chassis.core.multimodal_embeds.precomputed_items`); ``ValueError``
        without ``enable_mm_embeds``, and the counts checked again (one tensor may hold
        several)."""
        given = [m for m, values in items.items() if any(is_embeds_item(v, m) for v in values)]
        if not self.config.enable_mm_embeds:
            raise ValueError(flag_refusal(given[0]))
        name = self.config.served_model_name or self.config.model or ""
        cls = self._model_class()
        items = dict(items)
        for modality in given:
            items[modality] = precomputed_items(
                items[modality], cls, self._hf_config, name, modality
            )
        self.check_counts({modality: len(values) for modality, values in items.items()})
        return items

    def _model_class(self) -> Any:
        from chassis.core.model_loader import engine_hf_config, model_class

        if self._model_cls is None:
            self._hf_config = engine_hf_config(self.config)
            self._model_cls = model_class(self._hf_config)
        return self._model_cls

    def _build_processor(self) -> MultiModalProcessor:
        cls = self._model_class()
        assert self.config.model is not None
        processor = cls.multimodal_processor(self.config.model, self._hf_config)
        if processor is None:
            raise ValueError(f"{cls.__name__} has no multimodal processor: it takes text only")
        processor.item_cache = self.item_cache
        assert self.tokenizer is not None  # (check_counts refused the request without one)
        for modality, token in processor.placeholder_token_ids.items():
            text = processor.prompt_placeholder(modality)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if ids.count(token) != 1:
                raise ValueError(
                    f"the tokenizer ({self.config.tokenizer}) does not encode the model's "
                    f"{modality} placeholder {text!r} to its token id {token}: "
                    f"{modality} inputs need the model's own tokenizer"
                )
        return processor


def multimodal_items(multi_modal_data: Mapping[str, Any]) -> dict[str, list[Any]]:
    """vLLM's ``multi_modal_data`` as modality -> its items in order: one item alone (an
    image, an audio's ``(waveform, sample_rate)`` tuple) is a list of one; ``ValueError``
    when it is not a mapping. As in vLLM, a
    ``"video"`` list of PIL images is ONE video (its frames), and so is a ``(frames,
    metadata)`` tuple (:func:`video_frames_and_metadata`); a list of arrays, of frame lists
    or of such tuples is several videos."""
    if not isinstance(multi_modal_data, Mapping):
        raise ValueError(
            'multi_modal_data must be a dict like {"image": image} or {"image": [images]}; '
            f"got {type(multi_modal_data).__name__}"
        )
    return {
        str(modality): list(value)
        if isinstance(value, list | tuple)
        and not _is_frame_list(modality, value)
        and not _is_one_audio(modality, value)
        else [value]
        for modality, value in multi_modal_data.items()
    }


def _is_one_audio(modality: str, value: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``value`` is one audio clip: vLLM's ``(waveform, sample_rate)`` tuple."""
    return (
        modality == "audio"
        and isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[1], numbers.Real)  # (numpy's scalars too)
        and not isinstance(value[1], bool)
    )


def _is_frame_list(modality: str, value: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``value`` is one video: a list of PIL frames, or a ``(frames, metadata)``
    tuple."""
    if modality != "video" or not value:
        return False
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        return True
    from PIL import Image

    return all(isinstance(frame, Image.Image) for frame in value)


def video_frames_and_metadata(video: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """A video item's frames (an array or a list of PIL images, checked by the model's
    processor) and its metadata: vLLM's ``(frames, metadata)`` tuple, which
    :class:`~chassis.core.video_loading.VideoLoader` gives and offline callers may pass,
    ``metadata`` a dict of transformers' ``VideoMetadata`` fields (``fps``, the video's own
    rate; ``total_num_frames``; ``frames_indices``, the frames kept; ``duration``); or the
    frames alone (``None``). ``ValueError`` for metadata that is not such a dict."""
    if not (isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping)):
        return video, None
    frames, metadata = video
    for key in ("fps", "duration"):
        value = metadata.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
        ):
            raise ValueError(f"a video's metadata {key!r} must be a number > 0; got {value!r}")
    total = metadata.get("total_num_frames")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ValueError(
            f"a video's metadata 'total_num_frames' must be an integer >= 1; got {total!r}"
        )
    indices = metadata.get("frames_indices")
    if indices is not None and not isinstance(indices, list | tuple | range):
        raise ValueError(
            "a video's metadata 'frames_indices' must be a list of frame indices; got "
            f"{type(indices).__name__}"
        )
    return frames, metadata


def sampled_fps(metadata: Mapping[str, Any]) -> float | None:
    """The rate of a video's kept frames in frames per second of video (transformers'
    ``VideoMetadata.sampled_fps``): ``fps * len(frames_indices) / total_num_frames``, or
    ``fps`` when the metadata lacks the indices or the total; ``None`` without ``fps``."""
    fps = metadata.get("fps")
    if not fps:
        return None
    indices, total = metadata.get("frames_indices"), metadata.get("total_num_frames")
    if indices is None or not total:
        return float(fps)
    return len(indices) / total * float(fps)


def shift_features(features: list[MultiModalFeature], dropped: int) -> list[MultiModalFeature]:
    """``features`` of a prompt whose first ``dropped`` tokens truncation removed (offsets
    moved back); ``ValueError`` when the cut removes placeholder tokens of an item."""
    first = features[0]
    if first.offset < dropped:
        raise ValueError(
            f"truncate_prompt_tokens drops the prompt's first {dropped} tokens, among them "
            f"the placeholder tokens of its first {first.modality} (tokens {first.offset} to "
            f"{first.end - 1}); keep more tokens"
        )
    return [msgspec.structs.replace(f, offset=f.offset - dropped) for f in features]
