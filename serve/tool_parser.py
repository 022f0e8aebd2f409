"""The interface of tool-call parsers (``--tool-call-parser``): find the function calls in a
generated chat message.

A model that was given ``tools`` writes its calls as text in its own format (Hermes'
``<tool_call>{...}</tool_call>``, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``...). With
``--enable-auto-tool-choice`` and a parser, ``/v1/chat/completions`` returns those calls as
OpenAI ``tool_calls`` (finish reason ``tool_calls``) and only the rest of the text as content.

Plugins register subclasses with the ``chassis_register_tool_parsers`` hook.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One function call: the function's ``name`` and its ``arguments`` as JSON text (an
    object), as OpenAI's ``function.arguments`` carries them. ``id`` is the call's id when the
    model wrote one (some formats carry it); ``None`` lets the server make one
    (:meth:`ToolParser.new_call_id`)."""

    name: str
    arguments: str
    id: str | None = None


@dataclass
class ToolDelta:
    """What a parser has recognised: new plain text (``content``) and completed calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolParser(ABC):
    """Finds tool calls in one generated message (one choice).

    The server builds one instance per choice of a request that has ``tools`` (and a
    ``tool_choice`` other than ``"none"``), calls :meth:`feed` with each new piece of the
    message's content, in order, and :meth:`finish` once at the end. A call is reported when
    it is complete (its arguments whole), never in parts. Text that turns out not to be a
    valid call is returned as content, so nothing the model wrote is lost. Concatenating every
    returned delta must give the same content and calls whatever the pieces were; :meth:`parse`
    of the whole text, the non-streamed path, is feed-then-finish by default.

    ``tokenizer`` is the served model's tokenizer; ``tools`` the request's ``tools`` list
    (OpenAI's shape: ``{"type": "function", "function": {"name", "parameters", ...}}``).
    """

    #: The format's markers are special tokens, which the detokenizer drops by default; when
    #: true, the server asks for the text with special tokens (``skip_special_tokens=False``).
    needs_special_tokens: bool = False
    #: The finish reason of a choice that stopped after its calls: OpenAI's ``tool_calls``;
    #: ``stop`` for output forced to be one named function's call (OpenAI's and vLLM's answer).
    finish_reason_after_calls: str = "tool_calls"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.tools = tools

    @abstractmethod
    def feed(self, text: str) -> ToolDelta:
        """Scan ``text``, the next piece of the message; return the content and the calls
        known now (possibly nothing)."""

    @abstractmethod
    def finish(self) -> ToolDelta:
        """Generation ended: return everything still held back, a call cut short by the end
        included when it is complete enough to parse. Called once, last."""

    def new_call_id(self) -> str:
        """A fresh id for a call the model wrote without one. OpenAI's shape by default
        (``call_`` and 24 hex digits); formats whose chat templates check the ids they get
        back (Mistral's want 9 letters and digits) override it."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> ToolDelta:
        """The whole message at once (non-streamed responses)."""
        delta = self.feed(text)
        delta += self.finish()
        return delta
