"""The images of a Responses conversation: its ``input_image`` parts found, admitted by the
engine and loaded before the prompt renders, each refusal a 400 naming the part.

:func:`chassis.serve.responses_input.chat_messages` turns each ``input_image`` part into the
chat route's ``image_url`` part. Here, before the chat route renders the messages:

1. :func:`image_refs` lists the conversation's image parts in order, each with the ``param``
   a 400 names: ``input.N.content.M`` for a part of the request's own ``input``, and
   ``previous_response_id`` for one of an earlier turn (stored as it was sent);
2. :func:`load_images` asks the engine whether it takes that many images (a model that takes
   text only, ``--limit-mm-per-prompt``: the chat route's check and messages, naming the
   request's first image part) before any URL is fetched, then loads each image with the
   chat route's loader (data, http(s) and ``--allowed-local-media-path`` file URLs) in a
   worker thread;
3. :func:`with_images` puts each loaded image in its message as an ``image_pil`` part, which
   the chat renderer takes as it is (no second fetch).

An earlier turn's images are loaded again on every turn that continues it: the store keeps
the parts as they were sent, not the images (an http URL is fetched again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chassis.core.multimodal_inputs import ModalityRefusedError
from chassis.serve.errors import bad_request
from chassis.serve.message_parts import replace_parts
from chassis.serve.protocol import ChatMessage
from chassis.serve.responses_input import IMAGE_PART

if TYPE_CHECKING:
    from PIL.Image import Image

    from chassis.core.chat_media import ChatImages
    from chassis.core.image_loading import ImageLoader


@dataclass(frozen=True)
class ImageRef:
    """One ``input_image`` part of a conversation."""

    #: what a 400 about it names: ``input.N.content.M``, or ``previous_response_id``
    param: str
    #: how a message names it: ``input[N].content[M]``, or the earlier turn's item
    label: str
    url: str


def image_refs(items: Sequence[Mapping[str, Any]], num_earlier: int) -> list[ImageRef]:
    """The image parts of a conversation's items in order: the first ``num_earlier`` items
    are earlier turns' (through ``previous_response_id``), the rest the request's
    ``input``. The items were checked by ``chat_messages`` (each image part has its URL)."""
    refs = []
    for i, item in enumerate(items):
        content = item.get("content")
        if item.get("type", "message") != "message" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != IMAGE_PART:
                continue
            if i < num_earlier:
                param = "previous_response_id"
                label = f"previous_response_id (item {item.get('id')!r}, content[{j}])"
            else:
                param = f"input.{i - num_earlier}.content.{j}"
                label = f"input[{i - num_earlier}].content[{j}]"
            refs.append(ImageRef(param, label, part["image_url"]))
    return refs


async def load_images(chat_images: ChatImages | None, refs: Sequence[ImageRef]) -> list[Image]:
    """The images of ``refs``, in order, once the engine takes them (``chat_images``: the
    chat renderer's; ``None`` for an engine that takes no images). A 400 naming the
    request's first image part (the first of the earlier turns' when ``input`` has none)
    when the engine refuses them, and one naming the part for an image that cannot be
    loaded."""
    if not refs:
        return []
    first = next((ref for ref in refs if ref.param != "previous_response_id"), refs[0])
    if chat_images is None:
        raise bad_request(
            f"{first.label}: only text parts are supported (this server's engine takes no images)",
            first.param,
        )
    try:
        chat_images.multimodal.check_counts({"image": len(refs)})
    except ModalityRefusedError as exc:  # a text-only model: the chat route's words
        raise bad_request(
            f"{first.label}: only text parts are supported ({exc})", first.param
        ) from None
    except ValueError as exc:  # --limit-mm-per-prompt, an engine mode that takes no images
        raise bad_request(f"{first.label}: {exc}", first.param) from None
    return await asyncio.to_thread(_load_each, chat_images.loader, refs)


def _load_each(loader: ImageLoader, refs: Sequence[ImageRef]) -> list[Image]:
    images = []
    for ref in refs:
        try:
            images.append(loader.load(ref.url))
        except ValueError as exc:
            earlier = ref.param == "previous_response_id"
            again = " (an earlier turn's image, loaded again)" if earlier else ""
            raise bad_request(f"{ref.label}{again}: {exc}", ref.param) from None
    return images


def with_images(messages: list[ChatMessage], images: Sequence[Image]) -> list[ChatMessage]:
    """``messages`` with their ``image_url`` parts (made from the conversation's
    ``input_image`` parts, in the same order) replaced by ``image_pil`` parts holding
    ``images``; messages without images are kept, the others copied."""
    return replace_parts(messages, "image_url", "image_pil", images)
