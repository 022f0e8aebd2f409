"""The interface of reasoning parsers (``--reasoning-parser``): split a generated chat message
into the model's reasoning and its answer.

Reasoning models write their chain of thought before the answer, between markers such as
``<think>`` and ``</think>``. With a reasoning parser, ``/v1/chat/completions`` returns the
reasoning in the message's ``reasoning`` field (``delta.reasoning`` when streaming) and only
the answer in ``content``.

Plugins register subclasses with the ``chassis_register_reasoning_parsers`` hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from chassis.core.reasoning_gate import ReasoningTags

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningTags"]


@dataclass
class ReasoningDelta:
    """The part of a message a parser has classified: new reasoning text and new content."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser(ABC):
    """Splits one generated message (one choice) into reasoning and content.

    The server builds one instance per choice of a request, then calls :meth:`feed` with each
    new piece of the generated text, in order, and :meth:`finish` once when generation ends.
    A parser may hold text back while it cannot yet tell what it is (the start of a marker);
    :meth:`finish` releases everything still held. Concatenating every returned delta must
    give the same reasoning and content whatever the pieces were: :meth:`parse` of the whole
    text, the non-streamed path, is feed-then-finish by default.

    ``tokenizer`` is the served model's (transformers) tokenizer; ``prompt`` is the rendered
    prompt text, so a parser can tell whether the chat template already opened the reasoning
    (DeepSeek-R1 and Qwen3 thinking templates end the prompt with ``<think>``).
    """

    #: The format's markers are special tokens, which the detokenizer drops by default; when
    #: true, the server asks for the text with special tokens (``skip_special_tokens=False``),
    #: as for a tool parser's :attr:`~chassis.serve.tool_parser.ToolParser.needs_special_tokens`.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Classify ``text``, the next piece of the generated message; return what is known
        now (possibly nothing)."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Generation ended: return everything still held back. Called once, last."""

    @classmethod
    def reasoning_tags(cls, tokenizer: Any) -> ReasoningTags | None:
        """This format's markers as token ids, or ``None`` (the default) when the engine
        cannot tell reasoning from the answer by token ids.

        With tags, a request with structured outputs that asks for it
        (``StructuredOutputsParams.after_reasoning``, which the chat route sets for JSON
        constraints) may reason freely first: the engine core leaves the output
        unconstrained but for EOS while it is in reasoning, which it is when the
        prompt leaves the start tag open (its last start tag comes after its last end tag),
        when :attr:`ReasoningTags.starts_in_reasoning`, or after the start tag as the first
        output token; the constraint applies from the token after the end tag. Without tags
        the whole output is constrained, and the server does not run this parser on it.
        """
        return None

    def parse(self, text: str) -> ReasoningDelta:
        """The whole message at once (non-streamed responses)."""
        delta = self.feed(text)
        delta += self.finish()
        return delta
