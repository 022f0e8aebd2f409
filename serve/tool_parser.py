"""The interface of tool-call parsers (``--tool-call-parser``): find the function calls in a
generated chat message.

A model that was given ``tools`` writes its calls as text in its own format (Hermes'
``<tool_call>{...}</tool_call>``, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``...). With
``--enable-auto-tool-choice`` and a parser, ``/v1/chat/completions`` returns those calls as
OpenAI ``tool_calls`` (finish reason ``tool_calls``) and only the rest of the text as content.

Plugins register subclasses with the ``chassis_register_tool_parsers`` hook.

Two ways to report calls (see :class:`ToolParser`): whole, in :attr:`ToolDelta.calls`, once a
call is complete (any parser; the server then streams each call in one delta), or streamed,
as :class:`ToolCallFragment`\\ s in :attr:`ToolDelta.fragments`: the call's start (name, and
the model's id if it wrote one) as soon as the parser commits to it, then its arguments text
in pieces as the model writes them (the server streams each piece, as OpenAI does).
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


@dataclass(frozen=True)
class ToolCallFragment:
    """A piece of a call streamed as it is written.

    ``index`` is the call's position among the calls of the message (0, 1, ...). A call's
    first fragment *starts* it: its ``name`` is set (and ``id``, when the model wrote one);
    every later fragment of the call has ``name`` ``None`` and carries the next piece of its
    ``arguments`` text. A call's arguments are the concatenation of its fragments'
    ``arguments``, in order; a whole call may be one fragment.
    """

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    @property
    def starts_call(self) -> bool:
        """This is the call's first fragment (it names the function)."""
        return self.name is not None


@dataclass
class ToolDelta:
    """What a parser has recognised: new plain text (``content``), completed calls
    (``calls``) and pieces of streamed calls (``fragments``). A parser reports all its calls
    one way, whole or as fragments, never both in one message."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    fragments: list[ToolCallFragment] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls += other.calls
        self.fragments += other.fragments
        return self

    def start_call(self, index: int, name: str, call_id: str | None = None) -> None:
        """Add the first fragment of call ``index`` (no arguments yet)."""
        self.fragments.append(ToolCallFragment(index, "", name, call_id))

    def add_arguments(self, index: int, text: str) -> None:
        """Add ``text``, the next piece of call ``index``'s arguments (nothing when empty)."""
        if text:
            self.fragments.append(ToolCallFragment(index, text))

    def add_whole_call(self, index: int, call: ToolCall) -> None:
        """Add ``call``, complete, as call ``index``'s only fragment (a streaming parser's
        calls that could not be streamed)."""
        self.fragments.append(ToolCallFragment(index, call.arguments, call.name, call.id))

    def add_whole_calls(self, first_index: int, calls: list[ToolCall]) -> int:
        """Add ``calls``, complete, as calls ``first_index``, ``first_index + 1``, ... (see
        :meth:`add_whole_call`); return the index the message's next call gets."""
        for offset, call in enumerate(calls):
            self.add_whole_call(first_index + offset, call)
        return first_index + len(calls)

    def whole_calls(self) -> list[ToolCall]:
        """The calls of this delta, complete: :attr:`calls`, or the :attr:`fragments` joined
        per call (for a delta that holds every fragment of its calls, e.g. :meth:`ToolParser.
        parse`'s). Raises ``ValueError`` for fragments of a call that was not started."""
        return self.calls + join_fragments(self.fragments)


def join_fragments(fragments: list[ToolCallFragment]) -> list[ToolCall]:
    """The calls ``fragments`` make, in the order they were started; each call's arguments
    are its fragments' pieces joined. Raises ``ValueError`` for a fragment whose call was not
    started, or a call started twice."""
    names: dict[int, tuple[str, str | None]] = {}
    pieces: dict[int, list[str]] = {}
    for fragment in fragments:
        if fragment.starts_call:
            if fragment.index in names:
                raise ValueError(f"tool call {fragment.index} was started twice")
            names[fragment.index] = (fragment.name or "", fragment.id)
            pieces[fragment.index] = []
        elif fragment.index not in names:
            raise ValueError(
                f"a fragment of tool call {fragment.index} came before the call's start "
                "(its first fragment must carry the name)"
            )
        pieces[fragment.index].append(fragment.arguments)
    return [
        ToolCall(name, "".join(pieces[index]), call_id) for index, (name, call_id) in names.items()
    ]


class ToolParser(ABC):
    """Finds tool calls in one generated message (one choice).

    The server builds one instance per choice of a request that has ``tools`` (and a
    ``tool_choice`` other than ``"none"``), calls :meth:`feed` with each new piece of the
    message's content, in order, and :meth:`finish` once at the end. Text that turns out not
    to be a valid call is returned as content, so nothing the model wrote is lost.
    Concatenating every returned delta must give the same content and calls whatever the
    pieces were; :meth:`parse` of the whole text, the non-streamed path, is feed-then-finish
    by default, so both paths agree.

    Calls are reported one of two ways, the same way for the whole message:

    - **whole** (:attr:`ToolDelta.calls`): a call is reported when it is complete, its
      arguments whole. Every parser may do this; the server streams each such call in one
      delta.
    - **streamed** (:attr:`ToolDelta.fragments`, opt-in): the parser *commits* to a call as
      soon as it is sure enough of it (the built-ins: once the name and the opening ``{`` of
      the arguments are written) and reports its start, then each new piece of its arguments.
      A committed call cannot be taken back as content: if the model then writes something
      malformed, the call keeps what was streamed, and the parser says in its docstring what
      becomes of the rest (the built-ins append it to the arguments as written, which leaves
      them invalid JSON, as vLLM streams them). A call not yet committed may still turn out to
      be content. Fragments of one call come in order and calls do not interleave: a call's
      fragments end before the next call starts.

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
        """The whole message at once (non-streamed responses): its content and its calls,
        whole (a streaming parser's fragments joined, :meth:`ToolDelta.whole_calls`)."""
        delta = self.feed(text)
        delta += self.finish()
        return ToolDelta(delta.content, delta.whole_calls())
