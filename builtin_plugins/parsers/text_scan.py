"""Helpers the built-in parsers share for scanning streamed text for markers."""

from __future__ import annotations


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``marker`` (without being
    all of it): the characters a streaming parser must hold back, because the next piece of
    text may complete the marker. ``held_prefix_len("ok <tool", "<tool_call>") == 5``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def split_trailing_space(text: str) -> tuple[str, str]:
    """``text`` as (everything up to its trailing whitespace, that whitespace)."""
    body = text.rstrip()
    return body, text[len(body) :]


def hold_back(text: str, marker: str) -> tuple[str, str]:
    """``text`` as (what can be released now, what to hold): the held part is what may be the
    start of ``marker`` and the whitespace before it, for parsers that drop the whitespace
    next to a marker. ``hold_back("ok \n</thi", "</think>") == ("ok", " \n</thi")``."""
    keep = held_prefix_len(text, marker)
    body, space = split_trailing_space(text[: len(text) - keep])
    return body, space + text[len(text) - keep :]


def starts_with_after_tag(text: str, tag: str, opener: str) -> bool | None:
    """Whether ``text``, the start of a message so far, begins with ``opener`` once leading
    whitespace, an optional ``tag`` and the whitespace after it are skipped; ``None`` while
    that is not known yet (only whitespace, or whitespace and part of ``tag``, so far).
    ``starts_with_after_tag(" <|python_tag|> {", "<|python_tag|>", "{") is True``."""
    rest = text.lstrip()
    if rest.startswith(tag):
        rest = rest[len(tag) :].lstrip()
    elif tag.startswith(rest):  # nothing yet, or what may be the start of the tag
        return None
    if not rest:
        return None
    return rest.startswith(opener)


def text_after_call(held: str, content_before: bool) -> str | None:
    """The text that resumes after a tool call, or ``None`` while it is only whitespace. The
    whitespace that followed the call is kept when content came before the call (it keeps the
    texts on both sides apart) and dropped otherwise."""
    body = held.lstrip()
    if not body:
        return None
    return held if content_before else body


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``pos`` on
    (``len(text)`` when there is none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
