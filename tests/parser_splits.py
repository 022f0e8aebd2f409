"""Streaming a parser's input in pieces, for the tool-call and reasoning parser tests: every
parser must return the same result whatever the pieces (their contract)."""

from __future__ import annotations

import random
from itertools import pairwise
from typing import Any

from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser
from chassis.serve.tool_parser import ToolDelta, ToolParser


def random_pieces(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at random places (empty pieces included now and then)."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text) + 1)))
    return [text[a:b] for a, b in pairwise([0, *cuts, len(text)])]


def split_ways(text: str, count: int = 30) -> list[list[str]]:
    """``text`` whole, one character at a time, and cut ``count`` random ways (seeded by
    ``text``, so failures reproduce)."""
    rng = random.Random(text)
    return [[text], list(text), *(random_pieces(text, rng) for _ in range(count))]


def run_tool_parser(
    cls: type[ToolParser], pieces: list[str], tools: list[dict[str, Any]] | None = None
) -> ToolDelta:
    """Everything a fresh ``cls`` returns for ``pieces``, then :meth:`finish`: the content
    and the calls, whole (streamed calls' fragments joined)."""
    parser = cls(None, tools or [])
    total = ToolDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    return ToolDelta(total.content, total.whole_calls())


def run_reasoning_parser(
    cls: type[ReasoningParser], prompt: str, pieces: list[str]
) -> ReasoningDelta:
    """Everything a fresh ``cls`` (for ``prompt``) returns for ``pieces``, then finish."""
    parser = cls(None, prompt)
    total = ReasoningDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    return total
