"""MiniMax-M2's reasoning kept in the content (registered as ``minimax_m2_append_think``, as
in vLLM).

MiniMax-M2's template opens the think block in the prompt, so the output starts inside it
and the model writes only ``</think>``. MiniMax recommends giving the reasoning back in later
turns as written; this parser makes that easy: nothing is split off, and the content is the
whole output with the missing ``<think>`` put back in front (``<think>reasoning</think>
answer``), so a client that returns the message as it got it returns the think block whole.
The ``minimax_m2`` reasoning parser (:class:`~chassis.builtin_plugins.parsers.think_tags.
MiniMaxM2ReasoningParser`) splits the reasoning off instead.
"""

from __future__ import annotations

from typing import Any

from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser

START = "<think>"


class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    """All content, ``<think>`` first (also when the output is empty, as in vLLM)."""

    # the tags are added tokens of MiniMax-M2's tokenizer: keep ``</think>`` in the content
    needs_special_tokens = True

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        super().__init__(tokenizer, prompt)
        self._started = False

    def feed(self, text: str) -> ReasoningDelta:
        if not self._started:
            self._started = True
            text = START + text
        return ReasoningDelta(content=text)

    def finish(self) -> ReasoningDelta:
        return self.feed("")
