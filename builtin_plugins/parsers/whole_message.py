"""The shape of formats whose tool calls are the whole message and are read whole
(``pythonic``): a message that starts, after whitespace and an optional tag, with the format's
opening character is held to the end and is either all calls or all content. Such parsers
report whole calls (``ToolDelta.calls``), so each call is streamed in one delta."""

from __future__ import annotations

import enum
from abc import abstractmethod
from typing import Any

from chassis.builtin_plugins.parsers.text_scan import starts_with_after_tag
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and part of the start tag so far
    CONTENT = "content"
    CALLS = "calls"  # starts like calls: held to the end


class WholeMessageToolParser(ToolParser):
    """Subclasses set :attr:`start_tag` and :attr:`opener` and implement :meth:`calls_in`.

    A message that does not start with :attr:`opener` (after leading whitespace and an
    optional :attr:`start_tag`) is content and streams as it comes; one that does is held to
    the end, then returned as its calls when :meth:`calls_in` finds them, else, as written, as
    content.
    """

    #: optional tag before the calls (e.g. ``<|python_tag|>``)
    start_tag: str
    #: the character calls start with (``{`` or ``[``)
    opener: str

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.UNDECIDED
        self._held = ""

    @abstractmethod
    def calls_in(self, message: str) -> list[ToolCall] | None:
        """The calls of the whole ``message`` (leading whitespace and tag included, as
        written), or ``None`` when it is not wholly calls."""

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        if self._mode is _Mode.UNDECIDED:
            calls = starts_with_after_tag(self._held, self.start_tag, self.opener)
            if calls is None:
                return ToolDelta()
            self._mode = _Mode.CALLS if calls else _Mode.CONTENT
        if self._mode is _Mode.CALLS:
            return ToolDelta()
        held, self._held = self._held, ""
        return ToolDelta(content=held)

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        if self._mode is _Mode.CALLS:
            calls = self.calls_in(held)
            if calls is not None:
                return ToolDelta(calls=calls)
        return ToolDelta(content=held)
