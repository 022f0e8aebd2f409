"""Pydantic models of ``POST /v1/responses`` (OpenAI's Responses API): the request, its
output items and the response object.

A Responses request runs as a chat completion: :meth:`ResponsesRequest.chat_request` turns
it, with the conversation already turned into chat messages
(:mod:`chassis.serve.responses_input`), into a :class:`ChatCompletionRequest`, so sampling
defaults and limits, structured outputs, ``tools`` / ``tool_choice`` checks and the parsers
are the chat route's. Fields are OpenAI's, plus vLLM's sampling extras (``top_k``, ``seed``,
``stop``, ``repetition_penalty``...: what the ``openai`` client sends through ``extra_body``),
which reach the chat request unchanged. What this server does not implement is a 400 naming
the field (:meth:`ResponsesRequest.check`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from chassis.serve import structured_request
from chassis.serve.errors import APIError, bad_request
from chassis.serve.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ChatLogprobToken,
    ChatMessage,
    _SamplingRequest,
)
from chassis.serve.responses_include import check_include, wants_logprobs

#: OpenAI's bound on ``top_logprobs`` (the server's ``--max-logprobs`` may be lower)
MAX_TOP_LOGPROBS = 20

#: Fields of the shared sampling base that a Responses request may not use (Responses has no
#: choices, no chat-format response_format, no token-id or prompt-logprob fields).
_REFUSED_SAMPLING_FIELDS = {
    "use_beam_search": "beam search is not available on /v1/responses",
    "return_token_ids": "return_token_ids is not available on /v1/responses",
    "prompt_logprobs": "prompt_logprobs is not available on /v1/responses",
    "response_format": "/v1/responses takes the output format as text.format",
}
#: Sampling-base fields that do not reach the chat request (set from Responses fields, or
#: meaningless there).
_NOT_FORWARDED = {"model", "n", "stream", "stream_options", "user", "length_penalty"}


def _now() -> int:
    return int(time.time())


class ResponsesRequest(_SamplingRequest):
    """``POST /v1/responses``: ``input`` (a string: one user message; or a list of items:
    messages, with text and ``input_image`` parts, ``function_call`` and
    ``function_call_output`` items, ``reasoning`` items),
    ``instructions`` (a system message put first, not carried over by
    ``previous_response_id``), the sampling fields, ``tools`` (Responses' flat function
    tools), ``tool_choice``, ``text.format`` and ``store`` / ``previous_response_id``."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: ``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``
    text: dict[str, Any] | None = None
    #: echoed; its ``effort`` is the chat template's ``reasoning_effort`` (as the chat
    #: route's field); the reasoning itself is split off by ``--reasoning-parser``
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    #: run in the server after the request returns (:mod:`chassis.serve.responses_background`)
    background: bool | None = None
    # -- OpenAI fields accepted only with the values this server implements ---------------
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    # -- OpenAI fields accepted and ignored (about OpenAI's hosted service) -----------------
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    #: bounds calls of built-in tools, which this server has none of
    max_tool_calls: int | None = None
    # -- vLLM extras -----------------------------------------------------------------------
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the model's image processor settings for the conversation's images (Qwen2-VL:
    #: ``min_pixels``, ``max_pixels``), as on the chat route; ignored without images
    mm_processor_kwargs: dict[str, Any] | None = None
    #: not a field of vLLM's Responses request (chat completions have it): declared only to
    #: refuse it (:meth:`check`) instead of ignoring it; a request's own template goes in
    #: ``chat_template_kwargs.chat_template``
    chat_template: Any = None

    def check(self) -> None:
        """400s, naming the field, for what this server does not implement."""
        for name, why in _REFUSED_SAMPLING_FIELDS.items():
            if name in self.model_fields_set and getattr(self, name) not in (None, False):
                raise bad_request(why, name)
        if self.n not in (None, 1):
            raise bad_request("/v1/responses makes one output: n must be 1", "n")
        if self.chat_template is not None:
            raise bad_request(
                "/v1/responses has no chat_template field (as vLLM's): send the template as "
                "chat_template_kwargs.chat_template (the server must run with "
                "--trust-request-chat-template)",
                "chat_template",
            )
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            # here, not in the chat request, whose 400 would name max_tokens
            raise bad_request(
                f"max_output_tokens must be at least 1; got {self.max_output_tokens}",
                "max_output_tokens",
            )
        if self.background and self.store is False:
            # as OpenAI: a background response is only reachable through the store
            raise bad_request(
                "background responses must be stored: send store: true (the default) "
                "with background: true",
                "background",
            )
        if self.truncation not in (None, "disabled"):
            raise bad_request(
                "truncation 'auto' is not supported: a prompt longer than the context is a "
                "400 (use truncation 'disabled', or vLLM's truncate_prompt_tokens)",
                "truncation",
            )
        check_include(self.include)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}; got {self.top_logprobs}",
                "top_logprobs",
            )
        if self.conversation is not None:
            raise bad_request(
                "conversations are not supported: continue with previous_response_id",
                "conversation",
            )
        if self.prompt is not None:
            raise bad_request(
                "prompt templates are not supported: send input (and instructions)", "prompt"
            )
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise bad_request("input must not be empty", "input")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
                "reasoning.effort",
            )

    @property
    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the ``output_text`` logprobs carry
        (``top_logprobs``, 0 when unset), or ``None`` when ``include`` does not ask for
        logprobs (then none are computed, as OpenAI: ``top_logprobs`` alone adds nothing)."""
        return (self.top_logprobs or 0) if wants_logprobs(self.include) else None

    # -- to the chat route ---------------------------------------------------------------------

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` in the chat shape (``{"type": "function", "function": {...}}``); a 400 for
        built-in tools (web search, file search...), which this server does not run."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(
                    f"tools[{i}]: only function tools are supported; built-in tools such as "
                    f"{kind!r} are not (this server runs no tools itself)",
                    f"tools.{i}.type",
                )
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad_request(
                    f"tools[{i}] needs a non-empty string 'name' (Responses' function tools "
                    "are flat: {'type': 'function', 'name': ..., 'parameters': {...}})",
                    f"tools.{i}.name",
                )
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise bad_request(
                    f"tools[{i}].parameters must be a JSON Schema object",
                    f"tools.{i}.parameters",
                )
            out.append(_chat_tool(tool))
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice`` in the chat shape; a 400 for kinds this server cannot honour."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice  # "none", "auto", "required" (others: the chat route's 400)
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad_request(
                f"tool_choice: only 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'name': ...}} are supported; got {choice!r}",
                "tool_choice",
            )
        return {"type": "function", "function": {"name": name}}

    def chat_response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat route's ``response_format``."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise bad_request("text.format must be an object", "text.format")
        if fmt.get("type") != "json_schema":
            return fmt  # text, json_object (others: a 400 from the chat route)
        missing = [key for key in ("name", "schema") if key not in fmt]
        if missing:  # OpenAI requires both
            raise bad_request(
                f"text.format of type 'json_schema' needs {' and '.join(missing)}",
                "text.format",
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """This request as a chat completion of ``messages`` (the rendered conversation); its
        400s name the Responses field (``text.format``, not ``response_format``)."""
        values = {
            name: getattr(self, name)
            for name in _SamplingRequest.model_fields
            if name in self.model_fields_set and name not in _NOT_FORWARDED
        }
        values.pop("response_format", None)
        try:
            response_format = self.chat_response_format()
            # checked here too, so that its 400s name text.format (the chat route's would
            # name response_format)
            structured_request.from_request_fields(response_format, None, {})
        except APIError as exc:
            raise _renamed(exc, "text.format") from None
        return ChatCompletionRequest(
            **values,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            chat_template_kwargs=self.chat_template_kwargs,
            reasoning_effort=(self.reasoning or {}).get("effort"),
            logprobs=self.logprobs_asked is not None,
            top_logprobs=self.logprobs_asked,
        )


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    function = {
        key: tool[key]
        for key in ("name", "description", "parameters", "strict")
        if tool.get(key) is not None
    }
    return {"type": "function", "function": function}


def _renamed(exc: APIError, param: str) -> APIError:
    """``exc`` naming ``param`` (the Responses field) instead of the chat field; the
    chat shape's ``json_schema`` level is flat in ``text.format``."""
    message = exc.message.replace("response_format.json_schema.", f"{param}.")
    message = message.replace("response_format", param)
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type)


# ---------------------------------------------------------------------------------------------
# the response
# ---------------------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    """The message's text; ``logprobs`` its tokens' (empty unless ``include`` asks for
    ``message.output_text.logprobs``; see :mod:`chassis.serve.responses_logprobs`)."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogprobToken] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The assistant's text (one ``output_text`` part)."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    """The model's reasoning, split off by ``--reasoning-parser`` (no summaries: the server
    does not write them)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


class FunctionCallItem(BaseModel):
    """A call of one of the request's function tools; the client answers it with a
    ``function_call_output`` item of the same ``call_id``."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    #: the engine does not report prompt-cache writes
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """The response (``object: "response"``), also the ``response`` of the lifecycle stream
    events. ``status``: ``completed``; ``incomplete`` when ``max_output_tokens`` (or the
    context length) ended it; ``queued`` (a background response before the engine's first
    output) and ``in_progress`` while it is made; ``failed`` when the engine failed;
    ``cancelled`` when the server aborted it (shutdown) or it was cancelled."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["completed", "incomplete", "queued", "in_progress", "failed", "cancelled"]
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # -- echo of the request ------------------------------------------------------------------
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False


__all__ = [
    "FunctionCallItem",
    "OutputItem",
    "OutputMessage",
    "OutputText",
    "ReasoningItem",
    "ReasoningText",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
]
