"""Chat messages' image, video and audio parts -> the request's images, videos and clips
(``LLM.chat`` and the server's chat route share :class:`ChatImages`).

The parts taken are vLLM's: ``{"type": "image_url", "image_url": {"url": URL}}`` (the URL
also as a plain string; ``detail`` is ignored), a URL being a ``data:image/...;base64,`` URL,
an http(s) URL or a ``file://`` URL under ``--allowed-local-media-path``
(:mod:`chassis.core.image_loading`), and, offline, ``{"type": "image_pil", "image_pil":
PIL.Image.Image}``; and, where the caller takes videos, ``{"type": "video_url", "video_url":
{"url": URL}}`` with the same kinds of URL (``data:video/...;base64,``), decoded and sampled
by :mod:`chassis.core.video_loading` into vLLM's ``(frames, metadata)`` video item. Each
becomes the marker ``{"type": "image"}`` or ``{"type": "video"}`` in the messages (what chat
templates test for; :mod:`chassis.core.chat` writes it for the template), and its image or
video is loaded, in message order. With ``--enable-mm-embeds``, ``{"type": "image_embeds",
"image_embeds": ...}`` parts (vLLM's: the base64 of a ``torch.save``'d tensor, or a dict of
them for Qwen2-VL; offline, tensors too) stand for an image as well, their tensors loaded by
:func:`chassis.core.multimodal_embeds.load_embeds`; without the flag they are refused naming
it. Audio (Qwen2-Audio), where the caller takes it: OpenAI's ``{"type": "input_audio",
"input_audio": {"data": BASE64, "format": "wav" | "mp3"}}`` and vLLM's ``{"type":
"audio_url", "audio_url": {"url": URL}}`` (``data:audio/...;base64,``, http(s), ``file://``),
decoded by :mod:`chassis.core.audio_loading` into vLLM's ``(waveform, sample_rate)`` item
and marked ``{"type": "audio"}``; with ``--enable-mm-embeds`` also vLLM's ``{"type":
"audio_embeds", "audio_embeds": BASE64}`` (a ``torch.save``'d ``[rows, hidden]`` tensor); and,
offline, ``{"type": "audio_clip", "audio_clip": (waveform, sample_rate)}``, a clip already
decoded (``/v1/responses`` hands its decoded clips on so: :mod:`chassis.serve.
responses_audio`). Other media parts (files) are refused naming the type.

Before anything is loaded, the engine says whether it takes that many images and videos
(:meth:`chassis.core.multimodal_inputs.MultiModalInputs.check_counts`: a model that takes
text only, or images only, ``--limit-mm-per-prompt``), and PyAV must be installed for a
video: no URL is fetched for a request that is refused anyway. Every refusal is a
:class:`~chassis.core.chat.ChatMessageError` naming the part (``messages[0].content[1]:
...``), which the server answers with a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from chassis.core.audio_loading import AudioLoader, check_pyav_for_audio
from chassis.core.chat import AUDIO_PART, IMAGE_PART, VIDEO_PART, ChatMessageError
from chassis.core.multimodal_embeds import flag_refusal, load_embeds
from chassis.core.multimodal_inputs import ModalityRefusedError
from chassis.core.video_loading import VideoLoader, check_pyav

if TYPE_CHECKING:
    from PIL.Image import Image

    from chassis.core.image_loading import ImageLoader
    from chassis.core.multimodal_inputs import MultiModalInputs

#: the image part types taken (vLLM's)
IMAGE_PART_TYPES = ("image_url", "image_pil")
#: the video part types taken (vLLM's), where the caller takes videos
VIDEO_PART_TYPES = ("video_url",)
#: the image-embeddings part type (vLLM's), taken with --enable-mm-embeds
IMAGE_EMBEDS_PART_TYPE = "image_embeds"
#: media part types vLLM knows and chassis does not take: refused by name
UNSUPPORTED_PART_TYPES = (
    "input_image",
    "audio",
    "file",
    "input_file",
)
#: where video parts are taken (named when a route that takes none meets one)
VIDEO_ROUTES = "/v1/chat/completions and LLM.chat"
#: the audio-embeddings part type (vLLM's), taken with --enable-mm-embeds
AUDIO_EMBEDS_PART_TYPE = "audio_embeds"
#: the already-decoded audio part type (offline, as ``image_pil`` for images): the clip as
#: vLLM's ``(waveform, sample_rate)`` item
AUDIO_CLIP_PART_TYPE = "audio_clip"
#: the audio part types taken (OpenAI's and vLLM's), where the caller takes audio
AUDIO_PART_TYPES = ("input_audio", "audio_url", AUDIO_EMBEDS_PART_TYPE, AUDIO_CLIP_PART_TYPE)
#: where audio parts are taken
AUDIO_ROUTES = "/v1/chat/completions, /v1/responses and LLM.chat"


@dataclass
class ChatMedia:
    """The media of one conversation, as :meth:`ChatImages.extract_media` found them."""

    #: the messages with each media part replaced by its marker
    messages: list[Mapping[str, Any]]
    #: the loaded images (RGB PIL images; an image_embeds part's tensor or dict of
    #: tensors), in message order
    images: list[Image] = field(default_factory=list)
    #: the loaded videos, vLLM's ``(frames, metadata)`` items, in message order
    videos: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    #: the model's text for one image / one video (``None`` without any):
    #: :func:`chassis.core.chat.render_chat`'s ``image_placeholder`` / ``video_placeholder``
    image_placeholder: str | None = None
    video_placeholder: str | None = None
    #: the loaded audio clips, vLLM's ``(waveform, sample_rate)`` items (an audio_embeds
    #: part's tensor), in message order, and the model's text for one (``audio_placeholder``)
    audios: list[Any] = field(default_factory=list)
    audio_placeholder: str | None = None

    def multi_modal_data(self) -> dict[str, list[Any]] | None:
        """vLLM's ``multi_modal_data`` of the conversation; ``None`` without media."""
        data: dict[str, list[Any]] = {}
        if self.images:
            data["image"] = self.images
        if self.videos:
            data["video"] = self.videos
        if self.audios:
            data["audio"] = self.audios
        return data or None


#: one media part found: (message index, part index, the part)
_Found = tuple[int, int, Mapping[str, Any]]


class ChatImages:
    """Takes the image, video and audio parts of chat messages for one engine: its
    multimodal admission (``multimodal``: the input processor's), an image loader with its
    settings, and a video and an audio loader (``None``: ones reading the image loader's
    ``allowed_folder`` and ``allowed_domains``, vLLM's defaults otherwise;
    :func:`chassis.core.media_options.media_loaders` gives all three)."""

    def __init__(
        self,
        multimodal: MultiModalInputs,
        loader: ImageLoader,
        video_loader: VideoLoader | None = None,
        audio_loader: AudioLoader | None = None,
    ) -> None:
        self.multimodal = multimodal
        self.loader = loader
        self.video_loader = video_loader or VideoLoader(
            loader.allowed_folder, allowed_domains=getattr(loader, "allowed_domains", None)
        )
        self.audio_loader = audio_loader or AudioLoader(
            loader.allowed_folder, allowed_domains=getattr(loader, "allowed_domains", None)
        )

    def extract(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[Mapping[str, Any]], list[Image], str | None]:
        """``messages`` with each image part replaced by the marker, the loaded images in
        order, and the model's placeholder text for one image (``None`` without images):
        what :func:`chassis.core.chat.render_chat` takes as ``image_placeholder``. A video
        or audio part is refused naming the routes that take them. The input is not
        modified."""
        media = self.extract_media(messages, videos=False, audios=False)
        return media.messages, media.images, media.image_placeholder

    def extract_media(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        videos: bool = True,
        audios: bool = True,
    ) -> ChatMedia:
        """``messages`` with each image, video and audio part replaced by its marker, the
        loaded images, videos and clips, and the model's placeholder texts
        (:class:`ChatMedia`); with ``videos`` (``audios``) false a video (audio) part is
        refused naming the routes that take them. The input is not modified."""
        out, found = _mark_media_parts(messages, videos, audios)
        if not any(found.values()):
            return ChatMedia(out)
        for modality, kind in (
            ("image", IMAGE_EMBEDS_PART_TYPE),
            ("audio", AUDIO_EMBEDS_PART_TYPE),
        ):
            embeds = [part for part in found[modality] if part[2]["type"] == kind]
            if embeds and not self.multimodal.config.enable_mm_embeds:
                i, j, _ = embeds[0]
                raise ChatMessageError(f"messages[{i}].content[{j}]: {flag_refusal(modality)}", i)
        placeholders: dict[str, str] = {}
        for modality, parts in found.items():
            if parts:
                placeholders[modality] = self._admit(modality, parts)
        if found["video"]:
            _named(found["video"][0], lambda _: check_pyav())  # (before any URL is fetched)
        undecoded = (AUDIO_EMBEDS_PART_TYPE, AUDIO_CLIP_PART_TYPE)
        clips = [part for part in found["audio"] if part[2]["type"] not in undecoded]
        if clips:  # (embeddings and decoded clips need no decoder)
            _named(clips[0], lambda _: check_pyav_for_audio())
        media = ChatMedia(
            out,
            [],
            [],
            placeholders.get("image"),
            placeholders.get("video"),
            audio_placeholder=placeholders.get("audio"),
        )
        for part in found["image"]:
            media.images.append(_named(part, self._load_image))
        for part in found["video"]:
            media.videos.append(_named(part, lambda p: self.video_loader.load(_video_url(p))))
        for part in found["audio"]:
            media.audios.append(_named(part, self._load_audio))
        return media

    def _admit(self, modality: str, parts: list[_Found]) -> str:
        """The model's placeholder text for one item of ``modality`` once the engine takes
        ``len(parts)`` of them; a ``ChatMessageError`` naming the first part otherwise."""
        i, j, _ = parts[0]
        try:
            self.multimodal.check_counts({modality: len(parts)})
            return self.multimodal.processor().prompt_placeholder(modality)
        except ModalityRefusedError as exc:  # (as for any other part the model cannot take)
            taken = " and ".join(["text", *sorted(self.multimodal.supported_modalities())])
            raise ChatMessageError(
                f"messages[{i}].content[{j}]: only {taken} parts are supported ({exc})", i
            ) from None
        except ValueError as exc:
            raise ChatMessageError(f"messages[{i}].content[{j}]: {exc}", i) from None

    def _load_image(self, part: Mapping[str, Any]) -> Any:
        """An image part's image, or an image_embeds part's tensors (as ``multi_modal_data``
        takes them; the front-end checks them against the model)."""
        if part["type"] == IMAGE_EMBEDS_PART_TYPE:
            return load_embeds(part.get(IMAGE_EMBEDS_PART_TYPE))
        return self.loader.load(_image_source(part))

    def _load_audio(self, part: Mapping[str, Any]) -> tuple[Any, int]:
        """An audio part's clip: an input_audio part's base64 data, an audio_url's URL, an
        audio_clip part's clip as it is; an audio_embeds part's tensor (checked against the
        model by the front-end)."""
        if part["type"] == AUDIO_EMBEDS_PART_TYPE:
            return load_embeds(part.get(AUDIO_EMBEDS_PART_TYPE), "audio")
        if part["type"] == AUDIO_CLIP_PART_TYPE:
            return _decoded_clip(part.get(AUDIO_CLIP_PART_TYPE))
        if part["type"] == "input_audio":
            value = part.get("input_audio")
            if not isinstance(value, Mapping):
                raise ValueError(
                    'an input_audio part needs {"input_audio": {"data": BASE64, "format": '
                    '"wav" | "mp3"}}'
                )
            return self.audio_loader.load_input_audio(value.get("data"), value.get("format"))
        return self.audio_loader.load_url(_url(part, "audio_url"))


def _decoded_clip(clip: Any) -> tuple[Any, int]:
    """An audio_clip part's clip, once it is a ``(1-D float32 waveform, sample rate)``
    pair as the decoder gives (JSON cannot hold one: this part is for in-process callers)."""
    if isinstance(clip, tuple) and len(clip) == 2:
        waveform, rate = clip
        if (
            isinstance(waveform, np.ndarray)
            and waveform.ndim == 1
            and waveform.dtype == np.float32
            and isinstance(rate, int)
            and rate > 0
        ):
            return waveform, rate
    raise ValueError(
        "an audio_clip part needs its decoded clip: a (1-D float32 numpy waveform, sample "
        "rate) pair (in-process callers only; over HTTP send input_audio or audio_url parts)"
    )


def _named(found: _Found, load: Callable[[Mapping[str, Any]], Any]) -> Any:
    """``load(part)`` of a part found, a ``ValueError`` it raises as a ``ChatMessageError``
    naming the part."""
    i, j, part = found
    try:
        return load(part)
    except ValueError as exc:
        raise ChatMessageError(f"messages[{i}].content[{j}]: {exc}", i) from None


def _mark_media_parts(
    messages: Sequence[Mapping[str, Any]], videos: bool, audios: bool = False
) -> tuple[list[Mapping[str, Any]], dict[str, list[_Found]]]:
    """The messages with media parts replaced by markers (messages without any unchanged),
    and each image and video part with its message and part index. Unsupported media parts,
    video parts where ``videos`` is false, audio parts where ``audios`` is false, and a
    marker sent as a part are refused; other parts are left for the renderer to judge."""
    out: list[Mapping[str, Any]] = []
    found: dict[str, list[_Found]] = {"image": [], "video": [], "audio": []}
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        num_found = sum(map(len, found.values()))
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PART_TYPES or kind == IMAGE_EMBEDS_PART_TYPE:
                found["image"].append((i, j, part))
                parts.append(dict(IMAGE_PART))
            elif kind in VIDEO_PART_TYPES and videos:
                found["video"].append((i, j, part))
                parts.append(dict(VIDEO_PART))
            elif kind in AUDIO_PART_TYPES and audios:
                found["audio"].append((i, j, part))
                parts.append(dict(AUDIO_PART))
            elif kind in AUDIO_PART_TYPES:
                raise ChatMessageError(
                    f"messages[{i}].content[{j}]: {kind} parts are taken by {AUDIO_ROUTES} only",
                    i,
                )
            elif kind in VIDEO_PART_TYPES or kind == "video":
                what = (
                    f"video_url parts are taken by {VIDEO_ROUTES} only"
                    if kind == "video_url"
                    else "a video part needs its video"
                )
                raise ChatMessageError(
                    f"messages[{i}].content[{j}]: {what}; videos are sent as video_url parts "
                    '({"type": "video_url", "video_url": {"url": ...}}) to '
                    f"{VIDEO_ROUTES}",
                    i,
                )
            elif kind in UNSUPPORTED_PART_TYPES or kind == "image":
                what = (
                    "an image part needs its image"
                    if kind == "image"
                    else f"{kind} parts are not supported"
                )
                raise ChatMessageError(
                    f"messages[{i}].content[{j}]: {what}; images are sent as image_url parts "
                    '({"type": "image_url", "image_url": {"url": ...}}) or, offline, '
                    "image_pil parts",
                    i,
                )
            else:
                parts.append(part)
        changed = sum(map(len, found.values())) > num_found
        out.append({**message, "content": parts} if changed else message)
    return out, found


def _image_source(part: Mapping[str, Any]) -> Any:
    """What an image part carries: an image_url part's URL, an image_pil part's image."""
    if part["type"] == "image_pil":
        from PIL.Image import Image as PILImage

        image = part.get("image_pil")
        if not isinstance(image, PILImage):
            raise ValueError(
                "an image_pil part needs a field 'image_pil' holding a PIL.Image.Image "
                "(offline only; the server takes image_url parts)"
            )
        return image
    return _url(part, "image_url")


def _video_url(part: Mapping[str, Any]) -> str:
    """A video_url part's URL."""
    return _url(part, "video_url")


def _url(part: Mapping[str, Any], key: str) -> str:
    """The URL of an ``image_url`` / ``video_url`` part (``{key: {"url": URL}}`` or, as vLLM
    takes it, ``{key: URL}``); ``ValueError`` without one."""
    value = part.get(key)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f'a {key} part needs a URL: {{"type": "{key}", "{key}": {{"url": ...}}}}')
    return url
