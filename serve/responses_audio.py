"""The audio clips of a Responses conversation: its ``input_audio`` parts found, admitted by
the engine and decoded before the prompt renders, a refusal a 400 naming the request's part.

:func:`chassis.serve.responses_input.chat_messages` passes each ``input_audio`` part to the
chat route as it is. Here, first, :func:`audio_params` lists the parts with the ``param`` a
400 names (``input.N.content.M``, or ``previous_response_id`` for an earlier turn's), and
:func:`load_audio` asks the engine whether it takes that many clips: a model without audio
(``model 'm' (...) takes image inputs, not audio``) and ``--limit-mm-per-prompt`` are 400s
naming the request's first audio part, before anything is decoded. It then decodes every
clip once (off the event loop; wav or mp3, :mod:`chassis.core.audio_loading`, as on the chat
route), so that bytes that are no audio, or an unknown format, are a 400 naming the part as
Responses writes it (``input.N.content.M``), not the chat route's ``messages.N.content``.
:func:`with_audio` then puts the decoded clips in the messages as ``audio_clip`` parts
(:mod:`chassis.core.chat_media`), which the chat renderer takes as they are: no clip is
decoded twice, and they go to the engine as the request's ``multi_modal_data["audio"]``.
Earlier turns' clips are decoded again with each later turn (a 400 for one names
``previous_response_id``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from chassis.core.chat_media import AUDIO_CLIP_PART_TYPE
from chassis.core.multimodal_inputs import ModalityRefusedError
from chassis.serve.errors import bad_request
from chassis.serve.message_parts import replace_parts
from chassis.serve.protocol import ChatMessage
from chassis.serve.responses_input import AUDIO_PART

if TYPE_CHECKING:
    import numpy as np

    from chassis.core.chat_media import ChatImages


class AudioRef(NamedTuple):
    """One audio part of a conversation: the ``param`` a 400 names, the label its message
    starts with, and the part itself."""

    param: str
    label: str
    part: Mapping[str, Any]


def audio_params(items: Sequence[Mapping[str, Any]], num_earlier: int) -> list[AudioRef]:
    """Each audio part of a conversation's items, in order: the first ``num_earlier`` items
    are earlier turns' (``previous_response_id``), the rest the request's ``input``
    (``input.N.content.M``, labelled ``input[N].content[M]``)."""
    found = []
    for i, item in enumerate(items):
        content = item.get("content")
        if item.get("type", "message") != "message" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != AUDIO_PART:
                continue
            if i < num_earlier:
                label = f"previous_response_id (content[{j}])"
                found.append(AudioRef("previous_response_id", label, part))
            else:
                n = i - num_earlier
                found.append(AudioRef(f"input.{n}.content.{j}", f"input[{n}].content[{j}]", part))
    return found


async def load_audio(
    chat_images: ChatImages | None, refs: Sequence[AudioRef]
) -> list[tuple[np.ndarray, int]]:
    """Each part's decoded clip, vLLM's ``(waveform, sample_rate)``, in order; first a 400
    naming the request's first audio part (an earlier turn's when ``input`` has none) when
    the engine does not take ``len(refs)`` clips: no multimodal front-end, a model without
    audio, ``--limit-mm-per-prompt``, an engine mode that takes no media; then a 400 naming
    the first part whose clip cannot be decoded (bytes that are no audio, an unknown
    format). Nothing for a conversation without audio."""
    if not refs:
        return []
    param, label, _ = next((r for r in refs if r.param != "previous_response_id"), refs[0])
    if chat_images is None:
        raise bad_request(
            f"{label}: only text parts are supported (this server's engine takes no audio)",
            param,
        )
    try:
        chat_images.multimodal.check_counts({"audio": len(refs)})
    except ModalityRefusedError as exc:  # (the chat route's words)
        raise bad_request(f"{label}: audio parts are not supported ({exc})", param) from None
    except ValueError as exc:
        raise bad_request(f"{label}: {exc}", param) from None
    return await asyncio.to_thread(_decode_each, chat_images, refs)


def _decode_each(chat_images: ChatImages, refs: Sequence[AudioRef]) -> list[tuple[np.ndarray, int]]:
    """Each part's clip, a ``ValueError`` as a 400 naming the part."""
    loader = chat_images.audio_loader
    clips = []
    for ref in refs:
        value = ref.part.get(AUDIO_PART)
        value = value if isinstance(value, Mapping) else {}
        try:
            clips.append(loader.load_input_audio(value.get("data"), value.get("format")))
        except ValueError as exc:
            raise bad_request(f"{ref.label}: {exc}", ref.param) from None
    return clips


def with_audio(
    messages: list[ChatMessage], clips: Sequence[tuple[np.ndarray, int]]
) -> list[ChatMessage]:
    """``messages`` with their ``input_audio`` parts (the conversation's, in the same order
    as :func:`audio_params` lists them) replaced by ``audio_clip`` parts holding ``clips``,
    which the chat renderer takes without decoding; messages without audio are kept, the
    others copied."""
    return replace_parts(messages, AUDIO_PART, AUDIO_CLIP_PART_TYPE, clips)
