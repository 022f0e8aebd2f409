"""gpt-oss's tool calls in OpenAI's Harmony format (registered as ``openai``, vLLM's name)::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(one line; the recipient may also come before the channel: ``<|start|>assistant
to=functions.get_weather<|channel|>commentary json<|message|>...``). Each message addressed
``to=functions.NAME`` is a call of ``NAME`` (or ``to=NAME`` for a ``NAME`` among the
request's tools), its body the arguments; a turn may hold several, and a ``final`` message
after them. Content is the ``final`` messages' bodies and the ``commentary`` messages'
without a recipient (preambles), joined with ``\\n`` as vLLM joins them, and plain text
outside any message (what the ``openai_gptoss`` reasoning parser passes on: it reads the
other messages and forwards the calls whole). ``analysis`` messages are reasoning, which a
tool parser has no field for: without ``--reasoning-parser openai_gptoss`` they are dropped,
as vLLM drops them. Messages to another recipient (a built-in tool such as ``browser.search``)
outside ``analysis`` are not calls of the request's functions: they stay in the content as
written.

Calls stream: the header names the function, so a call is committed when its header ends
(``<|message|>``); its arguments are sent as they come, re-written as canonical JSON
(:class:`~chassis.builtin_plugins.parsers.json_rewrite.JsonRewriter`, ``json.dumps`` of the
object) when the content type is JSON or absent, as written otherwise. Arguments that stop
being JSON get the rest of the body appended as written (invalid JSON, as vLLM passes it);
what follows a complete JSON object in the body is dropped; a body cut short by the end of the
output leaves the arguments written so far; an empty body is ``{}``. A header cut short is
dropped (no call). The markers are special tokens (:attr:`needs_special_tokens`).
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.parsers.harmony_scan import (
    Close,
    Event,
    HarmonyScanner,
    Header,
    Open,
    Text,
)
from chassis.builtin_plugins.parsers.json_rewrite import JsonRewriter
from chassis.serve.tool_parser import ToolDelta, ToolParser


class _Arguments:
    """One call's arguments, from its body's text."""

    def __init__(self, index: int, content_type: str | None) -> None:
        self.index = index
        #: ``None``: the body is passed as written (a content type other than JSON, or
        #: JSON that broke)
        self._rewriter: JsonRewriter | None = None
        if content_type is None or "json" in content_type.lower():
            self._rewriter = JsonRewriter()
        self._blank = True

    def feed(self, text: str, out: ToolDelta) -> None:
        self._blank = self._blank and not text.strip()
        rewriter = self._rewriter
        if rewriter is None:
            out.add_arguments(self.index, text)
            return
        out.add_arguments(self.index, rewriter.feed(text))
        if rewriter.failed:  # the rest of the body, as written
            out.add_arguments(self.index, rewriter.rest)
            self._rewriter = None
        # done: what follows the object in the body is dropped (the rewriter keeps it)

    def close(self, out: ToolDelta) -> None:
        if self._blank:
            out.add_arguments(self.index, "{}")
        elif self._rewriter is not None and not self._rewriter.done:
            out.add_arguments(self.index, self._rewriter.pending())  # cut short


class HarmonyToolParser(ToolParser):
    """Calls from messages addressed ``to=functions.NAME`` (module docstring)."""

    needs_special_tokens = True

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._scanner = HarmonyScanner()
        self._names = {
            tool["function"]["name"]
            for tool in tools
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        }
        #: the open message's kind (``None``: plain text, no message open)
        self._kind: str | None = None
        self._fresh = False
        self._content_seen = False
        self._call: _Arguments | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        return self._apply(self._scanner.feed(text))

    def finish(self) -> ToolDelta:
        return self._apply(self._scanner.finish())

    def _function(self, header: Header) -> str | None:
        """The function ``header`` calls, or ``None``."""
        if header.function is not None:
            return header.function
        if header.recipient in self._names and header.channel != "analysis":
            return header.recipient
        return None

    def _apply(self, events: list[Event]) -> ToolDelta:
        out = ToolDelta()
        for event in events:
            if isinstance(event, Open):
                self._open(event.header, out)
            elif isinstance(event, Text):
                self._text(event.text, out)
            elif isinstance(event, Close):
                if self._call is not None:
                    self._call.close(out)
                    self._call = None
                elif self._kind == "addressed":
                    out.content += event.closing
                self._kind = None
        return out

    def _open(self, header: Header, out: ToolDelta) -> None:
        name = self._function(header)
        if name is not None:
            self._kind = "call"
            self._call = _Arguments(self._num_calls, header.content_type)
            out.start_call(self._num_calls, name)
            self._num_calls += 1
            return
        self._kind, self._fresh = header.kind, True
        if self._kind == "addressed":
            out.content += header.opening

    def _text(self, text: str, out: ToolDelta) -> None:
        if not text:
            return
        if self._call is not None:
            self._call.feed(text, out)
        elif self._kind in (None, "addressed"):
            out.content += text
            self._content_seen = self._content_seen or self._kind is None
        elif self._kind == "content":
            if self._fresh and self._content_seen:
                text = "\n" + text  # the next content message: joined as vLLM joins them
            self._fresh = False
            self._content_seen = True
            out.content += text
        # "reasoning": dropped (see the module docstring)
