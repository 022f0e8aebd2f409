"""gpt-oss's reasoning in OpenAI's Harmony format (registered as ``openai_gptoss``, vLLM's
name): the ``analysis`` channel is the reasoning, the ``final`` channel the content.

What each message of the turn becomes (:mod:`~chassis.builtin_plugins.parsers.harmony_scan`
reads them):

- ``analysis`` messages: reasoning (built-in tool calls written there, ``to=python``,
  included);
- ``final`` messages, ``commentary`` messages without a recipient (preambles the model writes
  for the user before its calls) and messages of any other channel: content, their bodies
  only; plain text outside any message is content as written;
- messages to a recipient (``to=functions.NAME``, tool calls) outside ``analysis``: passed
  on to the content whole, as a Harmony message (``<|start|>assistant...<|message|>...``,
  then the terminator written, or ``<|end|>`` when a new header cut the message short), for
  the tool parser (``openai``) to read; without tool parsing they stay there as text, as
  other formats' calls do. A ``to=functions.NAME`` message in ``analysis`` is passed on too:
  a call is never hidden in the reasoning.

Several messages of one kind are joined with a ``\\n``, as vLLM joins them; bodies are
otherwise kept as written (no whitespace is dropped). The markers are special tokens, so the
server keeps them in the text (:attr:`needs_special_tokens`). The output may start in a header
(the template ends with ``<|start|>assistant``) or in a body the prompt opened.
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.parsers.harmony_scan import (
    Close,
    Event,
    HarmonyScanner,
    Open,
    Text,
    open_message,
)
from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser


class HarmonyReasoningParser(ReasoningParser):
    """Reasoning from ``analysis`` messages, content from the others (module docstring)."""

    needs_special_tokens = True

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        super().__init__(tokenizer, prompt)
        self._scanner = HarmonyScanner(open_message(prompt or ""))
        #: the open message's kind (``None``: plain text, no message open)
        self._kind: str | None = None
        #: the open message has given no text yet (a separator may be due)
        self._fresh = False
        self._seen = {"reasoning": False, "content": False}

    def feed(self, text: str) -> ReasoningDelta:
        return self._apply(self._scanner.feed(text))

    def finish(self) -> ReasoningDelta:
        return self._apply(self._scanner.finish())

    def _apply(self, events: list[Event]) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in events:
            if isinstance(event, Open):
                self._kind, self._fresh = event.header.kind, True
                if self._kind in ("call", "addressed"):
                    out.content += event.header.opening
            elif isinstance(event, Text):
                self._text(event.text, out)
            elif isinstance(event, Close):
                if self._kind in ("call", "addressed"):
                    out.content += event.closing
                self._kind = None
        return out

    def _text(self, text: str, out: ReasoningDelta) -> None:
        if not text:
            return
        kind = self._kind
        if kind is None or kind in ("call", "addressed"):
            out.content += text
            self._seen["content"] = self._seen["content"] or kind is None
            return
        if self._fresh and self._seen[kind]:
            text = "\n" + text  # the next message of the kind: joined as vLLM joins them
        self._fresh = False
        self._seen[kind] = True
        if kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text
