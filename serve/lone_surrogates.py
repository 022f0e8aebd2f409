"""Find text a request cannot carry: lone UTF-16 surrogates.

JSON may write a string as ``\\ud83d`` escapes, and Python's decoder turns a lone one (no
partner, or a low one first) into a surrogate code point, which no UTF-8 encoder takes: the
tokenizer raised ``TypeError`` deep inside a route (a 500). The server refuses such a body
up front with a 400 naming the field (:func:`refuse_lone_surrogates`, the request models'
first validator; the check itself is core/lone_surrogates.py's). A correct pair
(``\\ud83d\\ude00``, how ``json.dumps`` writes an emoji by default) decodes to one
character and is never a surrogate.
"""

from __future__ import annotations

from typing import Any

from chassis.core.lone_surrogates import first_lone_surrogate, lone_surrogate_message
from chassis.serve.errors import bad_request

__all__ = ["first_lone_surrogate", "refuse_lone_surrogates"]


def refuse_lone_surrogates(data: Any) -> Any:
    """``data`` (a request body, as decoded) unchanged; a 400 naming the first field whose
    text holds a lone surrogate (core/lone_surrogates.py's rule, which the offline API
    shares). For a request model's ``model_validator(mode="before")``."""
    where = first_lone_surrogate(data)
    if where is not None:
        raise bad_request(lone_surrogate_message(where), where)
    return data
