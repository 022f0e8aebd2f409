"""IBM Granite 3.2+ reasoning (registered as ``granite``, as in vLLM)::

    Here is my thought process:
    The user wants ...

    Here is my response:
    Paris is ...

Granite's chat template, with ``chat_template_kwargs: {"thinking": true}``, asks the model to
write its thoughts after ``Here is my thought process:`` and its answer after ``Here is my
response:``; the markers are plain text, and, as vLLM does, ``Here's`` is accepted for
``Here is`` in both (quantized models write it).

A message that starts (after whitespace) with the thought marker is reasoning up to the
response marker, and content after it; a message that starts otherwise is all content (the
model was not asked to think). The whitespace next to the markers is dropped, as the
think-tag parsers drop it next to their tags. A response marker that never comes leaves the
rest of the message reasoning, as vLLM streams it (vLLM's non-streamed reading makes such a
message content; the two paths agree here). The markers are several tokens, so the engine
cannot tell reasoning from the answer by token ids (:meth:`reasoning_tags` is ``None``).
"""

from __future__ import annotations

import enum
from typing import Any

from chassis.builtin_plugins.parsers.text_scan import held_prefix_len, split_trailing_space
from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser

THOUGHT_MARKERS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_MARKERS = ("Here is my response:", "Here's my response:")


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace or the start of a thought marker so far
    REASONING_LEAD = "reasoning-lead"  # after the thought marker, no non-space yet
    REASONING = "reasoning"
    CONTENT_LEAD = "content-lead"
    CONTENT = "content"


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None


class GraniteReasoningParser(ReasoningParser):
    """``Here is my thought process: ... Here is my response: ...`` (see the module
    docstring)."""

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        super().__init__(tokenizer, prompt)
        self._mode = _Mode.UNDECIDED
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._held += text
        out = ReasoningDelta()
        while True:  # each pass changes the mode or returns; modes only move forward
            mode = self._mode
            if mode is _Mode.UNDECIDED:
                stripped = self._held.lstrip()
                marker = next((m for m in THOUGHT_MARKERS if stripped.startswith(m)), None)
                if marker is not None:
                    self._held = stripped[len(marker) :]
                    self._mode = _Mode.REASONING_LEAD
                elif not stripped or any(m.startswith(stripped) for m in THOUGHT_MARKERS):
                    return out  # may still become a thought marker
                else:
                    self._mode = _Mode.CONTENT_LEAD
            elif mode in (_Mode.REASONING_LEAD, _Mode.CONTENT_LEAD):
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._mode = _Mode.REASONING if mode is _Mode.REASONING_LEAD else _Mode.CONTENT
            elif mode is _Mode.REASONING:
                found = _first(self._held, RESPONSE_MARKERS)
                if found is not None:
                    at, marker = found
                    out.reasoning += self._held[:at].rstrip()
                    self._held = self._held[at + len(marker) :]
                    self._mode = _Mode.CONTENT_LEAD
                    continue
                # hold back what may be the start of a response marker, and the spaces before
                keep = max(held_prefix_len(self._held, m) for m in RESPONSE_MARKERS)
                body, space = split_trailing_space(self._held[: len(self._held) - keep])
                out.reasoning += body
                self._held = space + self._held[len(self._held) - keep :]
                return out
            else:
                out.content += self._held
                self._held = ""
                return out

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        mode = self._mode
        if mode is _Mode.UNDECIDED:
            return ReasoningDelta(content=held.lstrip())
        if mode is _Mode.REASONING:
            return ReasoningDelta(reasoning=held.rstrip())
        if mode is _Mode.REASONING_LEAD:
            return ReasoningDelta(reasoning=held.strip())
        return ReasoningDelta(content=held.lstrip() if mode is _Mode.CONTENT_LEAD else held)
