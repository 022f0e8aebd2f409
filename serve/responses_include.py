"""``include`` on ``/v1/responses``: OpenAI's values, and what this server does with each.

OpenAI's ``include`` asks for data to be added to a response's items: on ``POST
/v1/responses`` (to the response made), on ``GET /v1/responses/{id}`` (to the stored
response) and on ``GET /v1/responses/{id}/input_items`` (to the listed items). The same rule
holds in all three places (:func:`check_include`):

- values about items this server never makes or takes (built-in tools' results, image urls:
  it runs no tools itself and takes text input only) are accepted and add nothing, as there
  is nothing to add;
- ``message.output_text.logprobs`` and ``reasoning.encrypted_content`` name data this server
  neither makes on ``/v1/responses`` nor keeps: a 400 that says why, rather than a response
  silently without them;
- any other value is a 400 listing OpenAI's values.
"""

from __future__ import annotations

from chassis.serve.errors import bad_request

#: ``include`` values about items this server never makes or takes: nothing to add.
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
    "message.output_text.logprobs": (
        "this server does not make logprobs on /v1/responses, so none are stored either "
        "(use /v1/chat/completions with logprobs)"
    ),
    "reasoning.encrypted_content": (
        "this server does not encrypt reasoning: reasoning items are returned as text (with "
        "--reasoning-parser) and stored for previous_response_id"
    ),
}
#: every value OpenAI defines
INCLUDE_VALUES = INCLUDE_NOTHING_TO_ADD | INCLUDE_NOT_AVAILABLE.keys()


def check_include(include: list[str] | None) -> None:
    """A 400 naming ``include`` for a value this server cannot honour or does not know (see
    the module docstring); nothing for the others, which add nothing."""
    for value in include or []:
        if value in INCLUDE_NOTHING_TO_ADD:
            continue
        why = INCLUDE_NOT_AVAILABLE.get(value)
        if why is not None:
            raise bad_request(f"include {value!r} is not supported: {why}", "include")
        raise bad_request(
            f"include {value!r} is not a known value; OpenAI's values are "
            f"{', '.join(sorted(INCLUDE_VALUES))}",
            "include",
        )
