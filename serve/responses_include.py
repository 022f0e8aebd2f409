"""``include`` on ``/v1/responses``: OpenAI's values, and what this server does with each.

OpenAI's ``include`` asks for data to be added to a response's items: on ``POST
/v1/responses`` (to the response made), on ``GET /v1/responses/{id}`` (to the stored
response) and on ``GET /v1/responses/{id}/input_items`` (to the listed items). The same rule
holds in all three places (:func:`check_include`):

- values about items this server never makes (built-in tools' results: it runs no tools
  itself) are accepted and add nothing, as there is nothing to add;
- ``message.input_image.image_url`` (OpenAI: the input items' image URLs) is accepted and
  adds nothing either: every ``input_image`` part is kept and listed as it was sent, its
  ``image_url`` included, with or without it;
- ``message.output_text.logprobs`` adds each ``output_text`` part's ``logprobs``
  (:mod:`chassis.serve.responses_logprobs`): on ``POST`` it has the engine compute them
  (``top_logprobs`` alternatives per token) and they are stored with the response; on
  ``GET`` the stored ones are returned, and without it every part's ``logprobs`` is ``[]``
  (:func:`wants_logprobs`);
- ``reasoning.encrypted_content`` names data this server neither makes nor keeps (reasoning
  is returned as text): a 400 that says why, rather than a response silently without it;
- any other value is a 400 listing OpenAI's values.
"""

from __future__ import annotations

from typing import Any

from chassis.serve.errors import bad_request

#: the ``include`` value asking for the ``output_text`` parts' logprobs
LOGPROBS = "message.output_text.logprobs"

#: ``include`` values that add nothing here: about items this server never makes, or (the
#: input image URLs) data it always returns.
INCLUDE_NOTHING_TO_ADD = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
#: ``include`` values this server cannot honour, and why.
INCLUDE_NOT_AVAILABLE = {
    "reasoning.encrypted_content": (
        "this server does not encrypt reasoning: reasoning items are returned as text (with "
        "--reasoning-parser) and stored for previous_response_id"
    ),
}
#: every value OpenAI defines
INCLUDE_VALUES = INCLUDE_NOTHING_TO_ADD | INCLUDE_NOT_AVAILABLE.keys() | {LOGPROBS}


def check_include(include: list[str] | None) -> None:
    """A 400 naming ``include`` for a value this server cannot honour or does not know (see
    the module docstring); nothing for the others, which add nothing."""
    for value in include or []:
        if value in INCLUDE_NOTHING_TO_ADD or value == LOGPROBS:
            continue
        why = INCLUDE_NOT_AVAILABLE.get(value)
        if why is not None:
            raise bad_request(f"include {value!r} is not supported: {why}", "include")
        raise bad_request(
            f"include {value!r} is not a known value; OpenAI's values are "
            f"{', '.join(sorted(INCLUDE_VALUES))}",
            "include",
        )


def wants_logprobs(include: list[str] | None) -> bool:
    """Whether ``include`` asks for the ``output_text`` parts' logprobs."""
    return LOGPROBS in (include or [])


def without_logprobs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` (output or input items, as JSON) with every ``output_text`` part's
    ``logprobs`` emptied, as OpenAI answers when ``include`` does not ask for them; the
    items themselves are not changed (copies are made where a part had logprobs)."""
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("logprobs") for part in content
        ):
            parts = [
                {**part, "logprobs": []}
                if isinstance(part, dict) and part.get("logprobs")
                else part
                for part in content
            ]
            item = {**item, "content": parts}
        out.append(item)
    return out
