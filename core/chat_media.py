"""Chat messages' image parts -> the request's images (``LLM.chat`` and the server's chat
route share :class:`ChatImages`).

The parts taken are vLLM's: ``{"type": "image_url", "image_url": {"url": URL}}`` (the URL
also as a plain string; ``detail`` is ignored), a URL being a ``data:image/...;base64,`` URL,
an http(s) URL or a ``file://`` URL under ``--allowed-local-media-path``
(:mod:`chassis.core.image_loading`), and, offline, ``{"type": "image_pil", "image_pil":
PIL.Image.Image}``. Each becomes the marker ``{"type": "image"}`` in the messages (what chat
templates test for; :mod:`chassis.core.chat` writes it for the template), and its image is
loaded, in message order. Other media parts (video, audio, image embeddings, files) are
refused naming the type.

Before anything is loaded, the engine says whether it takes that many images
(:meth:`chassis.core.multimodal_inputs.MultiModalInputs.check_counts`: a model that takes
text only, ``--limit-mm-per-prompt``): no URL is fetched for a request that is refused
anyway. Every refusal is a :class:`~chassis.core.chat.ChatMessageError` naming the part
(``messages[0].content[1]: ...``), which the server answers with a 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from chassis.core.chat import IMAGE_PART, ChatMessageError
from chassis.core.multimodal_inputs import ModalityRefusedError

if TYPE_CHECKING:
    from PIL.Image import Image

    from chassis.core.image_loading import ImageLoader
    from chassis.core.multimodal_inputs import MultiModalInputs

#: the image part types taken (vLLM's)
IMAGE_PART_TYPES = ("image_url", "image_pil")
#: media part types vLLM knows and chassis does not take: refused by name
UNSUPPORTED_PART_TYPES = (
    "image_embeds",
    "input_image",
    "video_url",
    "video",
    "audio_url",
    "input_audio",
    "audio",
    "file",
    "input_file",
)


class ChatImages:
    """Takes the image parts of chat messages for one engine: its multimodal admission
    (``multimodal``: the input processor's) and an image loader with its settings."""

    def __init__(self, multimodal: MultiModalInputs, loader: ImageLoader) -> None:
        self.multimodal = multimodal
        self.loader = loader

    def extract(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[Mapping[str, Any]], list[Image], str | None]:
        """``messages`` with each image part replaced by the marker, the loaded images in
        order, and the model's placeholder text for one image (``None`` without images):
        what :func:`chassis.core.chat.render_chat` takes as ``image_placeholder``. The input
        is not modified."""
        out, found = _mark_image_parts(messages)
        if not found:
            return out, [], None
        i, j, _ = found[0]
        try:
            self.multimodal.check_counts({"image": len(found)})
            placeholder = self.multimodal.processor().prompt_placeholder("image")
        except ModalityRefusedError as exc:  # (a text-only model: as for any other part)
            raise ChatMessageError(
                f"messages[{i}].content[{j}]: only text parts are supported ({exc})", i
            ) from None
        except ValueError as exc:
            raise ChatMessageError(f"messages[{i}].content[{j}]: {exc}", i) from None
        images = []
        for i, j, part in found:
            try:
                images.append(self.loader.load(_image_source(part)))
            except ValueError as exc:
                raise ChatMessageError(f"messages[{i}].content[{j}]: {exc}", i) from None
        return out, images, placeholder


def _mark_image_parts(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[tuple[int, int, Mapping[str, Any]]]]:
    """The messages with image parts replaced by markers (messages without any unchanged),
    and each image part with its message and part index. Unsupported media parts, and a
    marker sent as a part, are refused; other parts are left for the renderer to judge."""
    out: list[Mapping[str, Any]] = []
    found: list[tuple[int, int, Mapping[str, Any]]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        num_found = len(found)
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PART_TYPES:
                found.append((i, j, part))
                parts.append(dict(IMAGE_PART))
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
        out.append({**message, "content": parts} if len(found) > num_found else message)
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
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError(
            'an image_url part needs a URL: {"type": "image_url", "image_url": {"url": ...}}'
        )
    return url
