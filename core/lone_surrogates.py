"""Find text no tokenizer can take: lone UTF-16 surrogates.

A Python ``str`` may hold a surrogate code point (``"\\ud800"``, or JSON's ``\\ud83d`` escape
decoded without its partner), which no UTF-8 encoder takes: the tokenizer raised a
``TypeError`` deep inside. Every entry point checks its text first with this one rule: the
offline API (:class:`chassis.core.llm.LLM`) raises :func:`refuse_lone_surrogates`'s
``ValueError`` naming the prompt or message, the server answers a 400 naming the field
(serve/lone_surrogates.py). A correct pair (``"\\ud83d\\ude00"`` in JSON) decodes to one
character and is never a surrogate.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def first_lone_surrogate(value: Any, path: tuple[str | int, ...] = ()) -> str | None:
    """The dotted path (``messages.0.content``; dict keys too) of the first string in
    ``value`` (a string, or dicts and lists of them, as decoded JSON) that holds a lone
    surrogate, or ``None``. An offending dict key is named by its own path; a string at the
    top with an empty ``path`` is named ``body``."""
    if isinstance(value, str):
        if not value.isascii() and _SURROGATE.search(value):
            return ".".join(str(p) for p in path) or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                return ".".join(str(p) for p in (*path, key))
            found = first_lone_surrogate(item, (*path, key))
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, str | dict | list | tuple):
                found = first_lone_surrogate(item, (*path, i))
                if found is not None:
                    return found
    return None


def lone_surrogate_message(where: str) -> str:
    """The error message for the text at ``where`` holding a lone surrogate."""
    return (
        f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
        "which is not valid Unicode text"
    )


def refuse_lone_surrogates(value: Any, name: str) -> None:
    """A ``ValueError`` naming the first string in ``value`` holding a lone surrogate (its
    path under ``name``: ``prompts.1``, ``messages.0.content``); nothing when there is none."""
    where = first_lone_surrogate(value, (name,))
    if where is not None:
        raise ValueError(lone_surrogate_message(where))
