"""The text around tool-call blocks that open with a tag (``qwen3_coder``'s and ``glm45``'s
``<tool_call>``, ``deepseek_v3``'s ``<｜tool▁calls▁begin｜>``), as ``hermes`` treats it.

Text before a block streams as content, except what may be the start of the tag and the
whitespace before it, which is held: dropped when the block holds a call, given back when
it does not. Text that resumes after a call keeps the whitespace that followed the call when
content came before the call (so the sentences around a call do not run together), and drops
it otherwise. What is inside a block is the subclass's: it reads the held text from the tag
on, step by step (:meth:`TaggedBlockToolParser.block_step`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from chassis.builtin_plugins.parsers.text_scan import (
    held_prefix_len,
    split_trailing_space,
    text_after_call,
)
from chassis.serve.tool_parser import ToolDelta, ToolParser

TEXT = "text"
AFTER_CALL = "after-call"  # text right after a call: its leading whitespace is held


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first of ``markers`` in ``text`` starts, and which it is (``None``: none)."""
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that may be the start of one of
    ``markers``: what must be held until the next piece tells."""
    return max((held_prefix_len(text, marker) for marker in markers), default=0)


class TaggedBlockToolParser(ToolParser):
    """Subclasses set :attr:`start_tag` and :attr:`block_mode` and implement
    :meth:`block_step`; they may read and set :attr:`mode` and :attr:`held`, drop text with
    :meth:`skip_to`, start calls with :meth:`start_call` (or :meth:`reserve_call`), and end a
    block with :meth:`after_call` or :meth:`not_a_call`.

    Calls stream as fragments: each is started (:meth:`start_call`) when the subclass commits
    to it, then its arguments are added piece by piece.
    """

    #: the tag that opens a block
    start_tag: str
    #: other spellings of :attr:`start_tag` that open a block too (Kimi-K2's singular
    #: ``<|tool_call_section_begin|>``); the subclass sees which one in :attr:`opened_with`
    start_tag_variants: tuple[str, ...] = ()
    #: the mode a block starts in (the subclass's first step after the tag)
    block_mode: str

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        #: :data:`TEXT`, :data:`AFTER_CALL`, or one of the subclass's modes
        self.mode = TEXT
        #: text read but not settled yet (in a block: from just after the tag)
        self.held = ""
        #: whitespace dropped before the open block: given back if the block is not a call
        self._gap = ""
        #: some content has been returned (whitespace after a call then separates)
        self._has_content = False
        #: the next call's index in the message
        self._num_calls = 0
        #: the tag that opened the open block (:attr:`start_tag` or one of its variants)
        self.opened_with = self.start_tag
        self._start_tags = (self.start_tag, *self.start_tag_variants)

    @abstractmethod
    def block_step(self, out: ToolDelta, final: bool) -> bool:
        """Advance over :attr:`held` in a block, adding what it settles to ``out``; whether
        to go on (the mode changed or text was consumed), false to wait for more text. When
        ``final`` (the message ended) nothing more comes: every step must settle what it
        holds, so that the message ends in :data:`TEXT` or :data:`AFTER_CALL`."""

    def feed(self, text: str) -> ToolDelta:
        self.held += text
        out = ToolDelta()
        self._scan(out, final=False)
        self._has_content = self._has_content or bool(out.content)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._scan(out, final=True)
        self.held = ""
        return out

    def start_call(self, out: ToolDelta, name: str) -> int:
        """Start the message's next call, named ``name``, in ``out``; its index (see
        :meth:`reserve_call`)."""
        index = self.reserve_call()
        out.start_call(index, name)
        return index

    def reserve_call(self) -> int:
        """The index of the message's next call, for a subclass that starts it itself. The
        block holds a call now: the whitespace before it is dropped."""
        index = self._num_calls
        self._num_calls += 1
        self._gap = ""
        return index

    def after_call(self) -> None:
        """The block ended after its calls: read :attr:`held` on as text after a call."""
        self.mode = AFTER_CALL
        self._gap = ""

    def not_a_call(self, out: ToolDelta) -> None:
        """The open block holds no call: its tag (and the whitespace before it) is content,
        and :attr:`held` is read on as text."""
        out.content += self._gap + self.opened_with
        self._gap = ""
        self.mode = TEXT

    def skip_to(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Drop :attr:`held` up to the first of ``markers`` and return that marker (``held``
        then starts with it); ``None`` when there is none: all of ``held`` is dropped but what
        may be the start of one (all of it when ``final``)."""
        found = first_marker(self.held, markers)
        if found is None:
            keep = 0 if final else partial_marker_len(self.held, markers)
            self.held = self.held[len(self.held) - keep :]
            return None
        at, marker = found
        self.held = self.held[at:]
        return marker

    def _scan(self, out: ToolDelta, final: bool) -> None:
        while True:
            if self.mode == AFTER_CALL:
                resumed = text_after_call(self.held, self._has_content or bool(out.content))
                if resumed is None:
                    return  # whitespace only so far (dropped at the end)
                self.held, self.mode = resumed, TEXT
            if self.mode == TEXT:
                found = first_marker(self.held, self._start_tags)
                if found is None:
                    if final:
                        out.content += self.held
                        self.held = ""
                    else:
                        keep = partial_marker_len(self.held, self._start_tags)
                        ready, space = split_trailing_space(self.held[: len(self.held) - keep])
                        self.held = space + self.held[len(self.held) - keep :]
                        out.content += ready
                    return
                start, self.opened_with = found
                before, self._gap = split_trailing_space(self.held[:start])
                out.content += before
                self.held = self.held[start + len(self.opened_with) :]
                self.mode = self.block_mode
                continue
            if not self.block_step(out, final):
                return
