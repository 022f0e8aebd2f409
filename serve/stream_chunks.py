"""The SSE events of a streamed completion, encoded without building pydantic models.

A streamed response sends one chunk per engine output, so the per-chunk cost is paid for
every token a server streams. Building a :class:`~chassis.serve.protocol.CompletionResponse`
or :class:`~chassis.serve.protocol.ChatCompletionChunk` and dumping it took ~5-7 us per
chunk; :class:`ChunkEncoder` writes the same JSON from plain dicts with msgspec in under 1 us.

The pydantic models stay the schema: ``tests/test_stream_chunks.py`` checks that every shape
of chunk encoded here equals the model's ``model_dump_json()`` byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pydantic import BaseModel

_encode = msgspec.json.Encoder().encode


def _model(value: BaseModel | None) -> dict[str, Any] | None:
    """A nested pydantic value (logprobs) as the dict its model would serialize."""
    return None if value is None else value.model_dump(mode="json")


class ChunkEncoder:
    """Encodes the chunks of one streamed response as ``data: {json}\\n\\n`` events (bytes).

    ``object`` is ``"text_completion"`` for ``/v1/completions`` and
    ``"chat.completion.chunk"`` for ``/v1/chat/completions``; ``id``, ``created`` and
    ``model`` are the same in every chunk of a response.
    """

    def __init__(self, object_type: str, response_id: str, created: int, model: str) -> None:
        self._head = {"id": response_id, "object": object_type, "created": created, "model": model}

    def event(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        prompt_token_ids: list[int] | None = None,
    ) -> bytes:
        """One event: the response's constant fields, ``choices`` and ``usage`` (or null):
        a :class:`~chassis.serve.protocol.UsageInfo` as a dict
        (``UsageCounter.as_dict()``); ``prompt_token_ids`` (a chat response's first chunk,
        with ``return_token_ids``) when given."""
        chunk = dict(self._head)
        chunk["choices"] = choices
        chunk["usage"] = usage
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
        return b"data: " + _encode(chunk) + b"\n\n"


def completion_choice(
    index: int,
    text: str,
    logprobs: BaseModel | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A streamed :class:`~chassis.serve.protocol.CompletionChoice` (no prompt logprobs:
    those only go in non-streamed responses); the token ids only when given
    (``return_token_ids``)."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": _model(logprobs),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_logprobs": None,
    }
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(
    index: int,
    role: str | None = None,
    content: str | None = None,
    logprobs: BaseModel | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A :class:`~chassis.serve.protocol.ChatStreamChoice`; the delta omits absent fields,
    as :class:`~chassis.serve.protocol.DeltaMessage` does, and carries ``reasoning`` under
    ``reasoning_content`` too. ``tool_calls`` items are passed as they are (see
    :func:`chassis.serve.chat_parsing.tool_call_delta_json`)."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning"] = reasoning
        delta["reasoning_content"] = reasoning  # the name other clients read, same text
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": _model(logprobs),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:  # return_token_ids: the ids new in this chunk
        choice["token_ids"] = token_ids
    return choice
