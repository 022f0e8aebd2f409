"""Where a constrained request's output stands relative to the model's reasoning.

With a reasoning format whose tags are single tokens (``ReasoningParser.reasoning_tags``),
structured outputs constrain only the answer: the model reasons freely first, as vLLM lets
it. The engine core follows each such request's tokens with a :class:`ReasoningGate`, using
the same rules as the reasoning parser that splits the text in the API server.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning format's markers as single token ids (what
    ``ReasoningParser.reasoning_tags`` returns)."""

    #: the token that opens the reasoning at the start of the output (``None``: none)
    start_token_id: int | None
    #: the token that ends it
    end_token_id: int
    #: the output starts in reasoning even without the opening token (DeepSeek-R1)
    starts_in_reasoning: bool = False


class Phase(enum.Enum):
    #: the next token is the first: the start tag (reasoning follows) or the answer's first
    UNDECIDED = "undecided"
    #: inside the reasoning: unconstrained until the end tag
    REASONING = "reasoning"
    #: the answer: constrained
    ANSWER = "answer"


class ReasoningGate:
    """Follows one request's output tokens through reasoning into the answer.

    ``tags`` ``None`` (no reasoning format, or one without single-token tags): the whole
    output is the answer. Otherwise the output starts in reasoning when the prompt leaves
    the start tag open (its last start tag is after its last end tag) or the format starts
    in reasoning, and is undecided otherwise: a start tag as the first token opens the
    reasoning, anything else begins the answer.
    """

    def __init__(self, tags: ReasoningTags | None, prompt_token_ids: Sequence[int]) -> None:
        self.tags = tags
        if tags is None:
            self.phase = Phase.ANSWER
            return
        opened = _last_index(prompt_token_ids, tags.start_token_id) > _last_index(
            prompt_token_ids, tags.end_token_id
        )
        if opened or tags.starts_in_reasoning:
            self.phase = Phase.REASONING
        elif tags.start_token_id is not None:
            self.phase = Phase.UNDECIDED
        else:
            self.phase = Phase.ANSWER

    @property
    def start_token_id(self) -> int | None:
        """The token allowed next besides the answer's first ones (while undecided)."""
        if self.phase is Phase.UNDECIDED and self.tags is not None:
            return self.tags.start_token_id
        return None

    def follow(self, token_id: int) -> bool:
        """Move past ``token_id``; ``True`` when it belongs to the answer (so the grammar
        must accept it), ``False`` for a token of the reasoning or a tag."""
        if self.phase is Phase.ANSWER:
            return True
        assert self.tags is not None
        if self.phase is Phase.UNDECIDED:
            if token_id == self.tags.start_token_id:
                self.phase = Phase.REASONING
                return False
            self.phase = Phase.ANSWER
            return True
        if token_id == self.tags.end_token_id:
            self.phase = Phase.ANSWER
        return False


def _last_index(ids: Sequence[int], token_id: int | None) -> int:
    if token_id is None:
        return -1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token_id:
            return i
    return -1
