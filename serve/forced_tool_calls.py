"""Tool calls read from output that was constrained to be them (``tool_choice`` ``"required"``
or a named function; the constraint is serve/structured_request.py:for_tool_choice).

These are not format parsers: the model wrote JSON because it could write nothing else, so
the whole message is held to the end and read as JSON. A message that is not complete JSON
(cut off by ``max_tokens``) comes back as content, as written.
"""

from __future__ import annotations

import json
from typing import Any

from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser


class _WholeJsonMessage(ToolParser):
    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._held = ""

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        return ToolDelta()

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        try:
            calls = self.calls_in(json.loads(held))
        except ValueError:  # cut short: not JSON (json.JSONDecodeError is a ValueError)
            calls = None
        return ToolDelta(calls=calls) if calls else ToolDelta(content=held)

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        raise NotImplementedError


class NamedToolCallParser(_WholeJsonMessage):
    """``tool_choice`` names a function (``tools`` holds just that one): the message is the
    arguments object of one call. The choice's finish reason stays ``stop`` (OpenAI's and
    vLLM's answer to a named function)."""

    finish_reason_after_calls = "stop"

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, dict):
            return None
        name = self.tools[0]["function"]["name"]
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))]


class RequiredToolCallsParser(_WholeJsonMessage):
    """``tool_choice: "required"``: the message is an array of ``{"name", "parameters"}``."""

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in value
        ):
            return None
        return [
            ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in value
        ]
