"""Think-tag reasoning whose answer the model wraps in tags of its own: ERNIE 4.5's
``<response>`` (registered as ``ernie45``) and Hunyuan-A13B's ``<answer>`` (``hunyuan_a13b``),
as vLLM names them::

    The user asks ... </think>

    <response>
    Paris.
    </response>

    <think>
    The user asks ...
    </think>
    <answer>
    Paris.
    </answer>

The reasoning is read as the think-tag parsers read it
(:mod:`~chassis.builtin_plugins.parsers.think_tags`): ``ernie45`` as ``deepseek_r1`` (the
output starts in reasoning, with or without ``<think>``: ERNIE's thinking models write only
``</think>``), ``hunyuan_a13b`` as ``qwen3`` (reasoning after a ``<think>`` that opens the
output or that the prompt left open; Hunyuan's no-thinking answers are content). Then, when
the content starts with the answer's opening tag, the tag and the whitespace after it are
dropped, and so is a closing tag that ends the message (with the whitespace around it). A
content that does not start with the opening tag is left as written, and so is a closing tag
followed by more text; nothing is lost. (vLLM keeps only what lies between the two tags when
both are present and drops the rest; Hunyuan's answer without reasoning keeps its
``<answer>`` there.)
"""

from __future__ import annotations

import enum
from typing import Any

from chassis.builtin_plugins.parsers.text_scan import held_prefix_len, split_trailing_space
from chassis.builtin_plugins.parsers.think_tags import ThinkTagReasoningParser
from chassis.serve.reasoning_parser import ReasoningDelta


class _Mode(enum.Enum):
    LEAD = "lead"  # nothing but (part of) the opening tag yet
    INNER_LEAD = "inner-lead"  # after the opening tag: its whitespace is dropped
    INNER = "inner"  # in the wrapped answer: a closing tag at the end is dropped
    PLAIN = "plain"  # not wrapped: as written


class AnswerUnwrapper:
    """Streams a message's content with its ``start``/``end`` wrapper dropped (see the module
    docstring); :meth:`feed` and :meth:`finish` give the same text whatever the pieces."""

    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._mode = _Mode.LEAD
        self._held = ""

    def feed(self, text: str) -> str:
        """The content settled by ``text``, the next piece of the content."""
        self._held += text
        out = ""
        while True:
            if self._mode is _Mode.LEAD:
                body = self._held.lstrip()
                if body.startswith(self._start):
                    self._held, self._mode = body[len(self._start) :], _Mode.INNER_LEAD
                elif self._start.startswith(body):
                    return out  # nothing yet, or what may be the opening tag
                else:
                    self._mode = _Mode.PLAIN
            elif self._mode is _Mode.INNER_LEAD:
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._mode = _Mode.INNER
            elif self._mode is _Mode.PLAIN:
                out += self._held
                self._held = ""
                return out
            else:
                at = self._held.find(self._end)
                if at < 0:  # hold what may be the closing tag, and the spaces before it
                    keep = held_prefix_len(self._held, self._end)
                    cut = len(self._held) - keep
                    body, space = split_trailing_space(self._held[:cut])
                    out += body
                    self._held = space + self._held[cut:]
                    return out
                after = at + len(self._end)
                if self._held[after:].strip():  # more text follows: the tag is text
                    out += self._held[:after]
                    self._held = self._held[after:]
                    continue
                body = self._held[:at].rstrip()  # the tag may end the message: held
                out += body
                self._held = self._held[len(body) :]
                return out

    def finish(self) -> str:
        """The content ended: the rest of it."""
        held, self._held = self._held, ""
        if self._mode is _Mode.INNER:
            at = held.find(self._end)
            if at >= 0 and not held[at + len(self._end) :].strip():
                return held[:at].rstrip()
            return held
        return "" if self._mode is _Mode.INNER_LEAD else held


class AnswerTagReasoningParser(ThinkTagReasoningParser):
    """A think-tag parser whose content is unwrapped of :attr:`answer_start` /
    :attr:`answer_end`."""

    answer_start: str
    answer_end: str

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        super().__init__(tokenizer, prompt)
        self._unwrap = AnswerUnwrapper(self.answer_start, self.answer_end)

    def feed(self, text: str) -> ReasoningDelta:
        delta = super().feed(text)
        delta.content = self._unwrap.feed(delta.content)
        return delta

    def finish(self) -> ReasoningDelta:
        delta = super().finish()
        delta.content = self._unwrap.feed(delta.content) + self._unwrap.finish()
        return delta


class Ernie45ReasoningParser(AnswerTagReasoningParser):
    """ERNIE 4.5 thinking models: ``reasoning</think>`` then the answer, maybe in
    ``<response>...</response>``."""

    starts_in_reasoning = True
    answer_start = "<response>"
    answer_end = "</response>"


class HunyuanA13BReasoningParser(AnswerTagReasoningParser):
    """Hunyuan-A13B: ``<think>reasoning</think>`` then ``<answer>...</answer>``."""

    answer_start = "<answer>"
    answer_end = "</answer>"
