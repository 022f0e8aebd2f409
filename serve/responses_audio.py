"""The audio clips of a Responses conversation: its ``input_audio`` parts found and admitted
by the engine before the prompt renders, a refusal a 400 naming the request's part.

:func:`chassis.serve.responses_input.chat_messages` passes each ``input_audio`` part to the
chat route as it is; the chat renderer decodes it (:mod:`chassis.core.chat_media`, wav or
mp3 as on the chat route) and the clips go to the engine as the request's
``multi_modal_data["audio"]``. Here, first, :func:`audio_params` lists the parts with the
``param`` a 400 names (``input.N.content.M``, or ``previous_response_id`` for an earlier
turn's), and :func:`check_audio` asks the engine whether it takes that many clips: a model
without audio (``model 'm' (...) takes image inputs, not audio``) and
``--limit-mm-per-prompt`` are 400s naming the request's first audio part, before anything
is decoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from chassis.core.multimodal_inputs import ModalityRefusedError
from chassis.serve.errors import bad_request
from chassis.serve.responses_input import AUDIO_PART

if TYPE_CHECKING:
    from chassis.core.chat_media import ChatImages


def audio_params(items: Sequence[Mapping[str, Any]], num_earlier: int) -> list[tuple[str, str]]:
    """``(param, label)`` of each audio part of a conversation's items, in order: the first
    ``num_earlier`` items are earlier turns' (``previous_response_id``), the rest the
    request's ``input`` (``input.N.content.M``, labelled ``input[N].content[M]``)."""
    found = []
    for i, item in enumerate(items):
        content = item.get("content")
        if item.get("type", "message") != "message" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != AUDIO_PART:
                continue
            if i < num_earlier:
                found.append(("previous_response_id", f"previous_response_id (content[{j}])"))
            else:
                n = i - num_earlier
                found.append((f"input.{n}.content.{j}", f"input[{n}].content[{j}]"))
    return found


def check_audio(chat_images: ChatImages | None, params: Sequence[tuple[str, str]]) -> None:
    """A 400 naming the request's first audio part (an earlier turn's when ``input`` has
    none) when the engine does not take ``len(params)`` clips: no multimodal front-end, a
    model without audio, ``--limit-mm-per-prompt``, an engine mode that takes no media.
    Nothing for a conversation without audio."""
    if not params:
        return
    param, label = next((p for p in params if p[0] != "previous_response_id"), params[0])
    if chat_images is None:
        raise bad_request(
            f"{label}: only text parts are supported (this server's engine takes no audio)",
            param,
        )
    try:
        chat_images.multimodal.check_counts({"audio": len(params)})
    except ModalityRefusedError as exc:  # (the chat route's words)
        raise bad_request(f"{label}: audio parts are not supported ({exc})", param) from None
    except ValueError as exc:
        raise bad_request(f"{label}: {exc}", param) from None
