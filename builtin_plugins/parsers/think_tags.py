"""Reasoning between ``<think>`` and ``</think>``: DeepSeek-R1, Qwen3 and the models that copy
their format (registered as ``deepseek_r1`` and ``qwen3``; ``deepseek_v3`` and ``glm45`` read
the tags as ``qwen3`` does, ``olmo3`` as ``deepseek_r1`` does, and ``seed_oss`` is
``deepseek_r1``'s reading of ``<seed:think>...</seed:think>``; ``minimax_m2`` reads ``<think>``
as ``deepseek_r1`` does, ``mistral`` reads ``[THINK]...[/THINK]`` as ``qwen3`` reads its tags).

Where the reasoning starts:

- after a ``<think>`` at the very start of the output (Qwen3 with thinking on writes one);
- at the start of the output when the prompt leaves a ``<think>`` open (DeepSeek-R1's and
  Qwen3-Thinking's templates end the prompt with ``<think>\\n``);
- for ``deepseek_r1``, at the start of the output in any case: R1 models may skip the opening
  tag, so text up to ``</think>`` is reasoning even without one.

Otherwise (Qwen3 with ``enable_thinking: false``, whose template closes an empty think block in
the prompt) the whole output is content. The reasoning ends at ``</think>``; what follows is
content. The whitespace next to the tags is dropped (they sit on their own lines): around the
reasoning, and at the start of the content.
"""

from __future__ import annotations

import enum
from typing import Any

from chassis.builtin_plugins.parsers.text_scan import hold_back
from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningTags


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # nothing but whitespace or the start of "<think>" seen yet
    REASONING_LEAD = "reasoning-lead"  # in reasoning, no non-space character seen yet
    REASONING = "reasoning"
    CONTENT_LEAD = "content-lead"
    CONTENT = "content"


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>reasoning</think>content`` (see the module docstring for where the reasoning
    starts). Subclasses set :attr:`starts_in_reasoning`."""

    start_tag = "<think>"
    end_tag = "</think>"
    #: the output begins in reasoning even without an opening tag
    starts_in_reasoning = False

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        super().__init__(tokenizer, prompt)
        opened_by_prompt = prompt.rfind(self.start_tag) > prompt.rfind(self.end_tag)
        self._default_reasoning = self.starts_in_reasoning or opened_by_prompt
        self._mode = _Mode.UNDECIDED
        self._held = ""

    @classmethod
    def reasoning_tags(cls, tokenizer: Any) -> ReasoningTags | None:
        """The tags' token ids when each tag is one token of ``tokenizer`` (as in Qwen3's
        and DeepSeek-R1's vocabularies), else ``None``."""
        ids = [_single_token(tokenizer, tag) for tag in (cls.start_tag, cls.end_tag)]
        if ids[0] is None or ids[1] is None:
            return None
        return ReasoningTags(ids[0], ids[1], cls.starts_in_reasoning)

    def feed(self, text: str) -> ReasoningDelta:
        self._held += text
        out = ReasoningDelta()
        # Each pass either changes mode or returns; modes only move forward.
        while True:
            mode = self._mode
            if mode is _Mode.UNDECIDED:
                stripped = self._held.lstrip()
                if stripped.startswith(self.start_tag):
                    self._held = stripped[len(self.start_tag) :]
                    self._mode = _Mode.REASONING_LEAD
                elif not stripped or self.start_tag.startswith(stripped):
                    return out  # may still become "<think>"
                else:
                    self._mode = (
                        _Mode.REASONING_LEAD if self._default_reasoning else _Mode.CONTENT_LEAD
                    )
            elif mode in (_Mode.REASONING_LEAD, _Mode.CONTENT_LEAD):
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._mode = _Mode.REASONING if mode is _Mode.REASONING_LEAD else _Mode.CONTENT
            elif mode is _Mode.REASONING:
                end = self._held.find(self.end_tag)
                if end >= 0:
                    out.reasoning += self._held[:end].rstrip()
                    self._held = self._held[end + len(self.end_tag) :]
                    self._mode = _Mode.CONTENT_LEAD
                    continue
                # Hold back what may be the start of "</think>" and the spaces before it.
                ready, self._held = hold_back(self._held, self.end_tag)
                out.reasoning += ready
                return out
            else:
                out.content += self._held
                self._held = ""
                return out

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        mode = self._mode
        if mode is _Mode.UNDECIDED:
            mode = _Mode.REASONING if self._default_reasoning else _Mode.CONTENT
            held = held.lstrip()
        if mode is _Mode.REASONING:
            # held: whitespace, then maybe the start of "</think>" that never came; the
            # whitespace is the reasoning's own unless nothing follows it
            return ReasoningDelta(reasoning=held.rstrip())
        if mode is _Mode.REASONING_LEAD:
            return ReasoningDelta(reasoning=held.strip())
        return ReasoningDelta(content=held.lstrip() if mode is _Mode.CONTENT_LEAD else held)


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3: reasoning only after a ``<think>`` (in the output or left open by the prompt)."""


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1: the output starts in reasoning, with or without ``<think>``."""

    starts_in_reasoning = True


class DeepSeekV3ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-V3.1 (``deepseek_v3``), ``qwen3``'s reading: V3.1's template ends the prompt
    with ``<think>`` when thinking is on (``chat_template_kwargs: {"thinking": true}``) and with
    ``</think>`` when it is off. vLLM picks its R1 parser or none from that request flag; the
    prompt tells the same here."""


class Glm45ReasoningParser(ThinkTagReasoningParser):
    """GLM-4.5 (``glm45``), ``qwen3``'s reading: the model opens ``<think>`` itself, and its
    template closes an empty think block in the prompt when ``enable_thinking`` is false."""

    # GLM-4.5's tags are added tokens; vLLM keeps them, as for its ``glm45`` tool parser
    needs_special_tokens = True


class Olmo3ReasoningParser(ThinkTagReasoningParser):
    """OLMo 3 Think (``olmo3``), ``deepseek_r1``'s reading: reasoning up to ``</think>``, the
    opening ``<think>`` optional (some OLMo 3 templates write it in the prompt). The tags are
    plain text in OLMo 3's vocabulary."""

    starts_in_reasoning = True


class SeedOssReasoningParser(ThinkTagReasoningParser):
    """Seed-OSS (``seed_oss``): ``<seed:think>reasoning</seed:think>content``, read as
    ``deepseek_r1`` reads its tags (the output starts in reasoning, with or without the opening
    tag). The budget notes Seed-OSS writes while thinking
    (``<seed:cot_budget_reflect>...``) stay in the reasoning."""

    start_tag = "<seed:think>"
    end_tag = "</seed:think>"
    starts_in_reasoning = True
    # the tags are special tokens of Seed-OSS's tokenizer
    needs_special_tokens = True


class MiniMaxM2ReasoningParser(ThinkTagReasoningParser):
    """MiniMax-M2 (``minimax_m2``), ``deepseek_r1``'s reading: M2's template opens the think
    block in the prompt, so the output is reasoning up to ``</think>`` (M2.5 writes the
    opening ``<think>`` too, which is read the same). ``minimax_m2_append_think``
    (:mod:`~chassis.builtin_plugins.parsers.minimax_m2_reasoning`) keeps it all as content
    instead."""

    starts_in_reasoning = True
    # the tags are added tokens of MiniMax-M2's tokenizer; kept in the text to be found
    needs_special_tokens = True


class MistralReasoningParser(ThinkTagReasoningParser):
    """Magistral and Mistral's reasoning models (``mistral``):
    ``[THINK]reasoning[/THINK]content``, read as ``qwen3`` reads its tags: reasoning only after
    a ``[THINK]`` at the start of the output (or left open by the prompt); without one the
    whole output is content, as vLLM's ``mistral`` parser reads it. Unlike vLLM, a
    ``[THINK]`` after other text is content, and the whitespace next to the tags is dropped."""

    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    # special tokens of Mistral's tokenizers (v13 and later)
    needs_special_tokens = True


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token ``tokenizer`` writes ``text`` as, or ``None``."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
