"""Find text a request cannot carry: lone UTF-16 surrogates.

JSON may write a string as ``\\ud83d`` escapes, and Python's decoder turns a lone one (no
partner, or a low one first) into a surrogate code point, which no UTF-8 encoder takes: the
tokenizer raised ``TypeError`` deep inside a route (a 500). The server refuses such a body
up front with a 400 naming the field (:func:`refuse_lone_surrogates`, the request models'
first validator). A correct pair
(``\\ud83d\\ude00``, how ``json.dumps`` writes an emoji by default) decodes to one
character and is never a surrogate.
"""

from __future__ import annotations

import re
from typing import Any

from chassis.serve.errors import bad_request

_SURROGATE = re.compile("[\ud800-\udfff]")


def first_lone_surrogate(value: Any, path: tuple[str | int, ...] = ()) -> str | None:
    """The dotted path (``messages.0.content``; dict keys too) of the first string in the
    decoded JSON ``value`` that holds a lone surrogate, or ``None``. An offending dict key is
    named by its own path."""
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
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | dict | list):
                found = first_lone_surrogate(item, (*path, i))
                if found is not None:
                    return found
    return None


def refuse_lone_surrogates(data: Any) -> Any:
    """``data`` (a request body, as decoded) unchanged; a 400 naming the first field whose
    text holds a lone surrogate. For a request model's ``model_validator(mode="before")``."""
    where = first_lone_surrogate(data)
    if where is not None:
        raise bad_request(
            f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not valid Unicode text",
            where,
        )
    return data
