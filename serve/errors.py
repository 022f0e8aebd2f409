"""Errors in OpenAI's shape, and the exception handlers that produce them.

Every error the server returns, whatever raised it, has the body::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

Status codes: 400 invalid request (including pydantic validation errors and malformed JSON,
never FastAPI's default 422), 401 missing or wrong API key, 404 unknown model or route,
405 wrong method, 409 sleep mode's ``POST /sleep`` while requests are unfinished, 413 body
too large, 431 headers too large, 503 engine dead, overloaded, sleeping (sleep mode) or
shutting down, 500 only for a bug in the server (the traceback is logged, never sent).
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chassis.core.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineOverloadedError,
    EngineSleepingError,
    RequestFailedError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

logger = logging.getLogger(__name__)

#: status -> OpenAI error ``type``
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}

#: The field a validation message is about, from its start (group 1): SamplingParams'
#: "invalid sampling parameter top_p: ...", and the input processor's refusals of token
#: ids ("logit_bias has token ids out of the vocabulary ...", "logprobs=6 exceeds ...").
_PARAM_IN_MESSAGE = re.compile(
    r"^(?:invalid sampling parameter (\w+):"
    r"|(stop_token_ids|logit_bias) has token ids out of the vocabulary"
    r"|(logprobs|prompt_logprobs)=-?\d+ exceeds the server's limit"
    r"|(priority) (?:-?\d+ was given|must be a 64-bit integer))"
)
#: Refusals of the prompt's own token ids -> the field that carried them: the input
#: processor's (completions' ``prompt``) and the pooling input's (embeddings' ``input``)
_IDS_FIELDS = (
    (re.compile(r"^prompt token ids (?:out of the vocabulary|must be integers)"), "prompt"),
    (re.compile(r"^input token ids out of the vocabulary"), "input"),
    (re.compile(r"^prompt_embeds "), "prompt_embeds"),  # (core/prompt_embeds.py's checks)
)


class APIError(Exception):
    """An error to return to the client with ``status`` in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400; ``param`` names the offending field when known."""
    return APIError(400, message, param=param)


def from_value_error(exc: ValueError) -> APIError:
    """A 400 from a ``ValueError`` raised by validation (SamplingParams, the engine, a template)."""
    message = str(exc) or type(exc).__name__
    match = _PARAM_IN_MESSAGE.match(message)
    if match:
        param = next(group for group in match.groups() if group)
    else:
        param = next((field for pattern, field in _IDS_FIELDS if pattern.match(message)), None)
    return APIError(400, message, param=param)


def engine_dead(exc: BaseException | None = None) -> APIError:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    return APIError(503, f"the engine is not running{detail}", code="engine_dead")


def overloaded(exc: BaseException | None = None) -> APIError:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    return APIError(503, f"the server is overloaded{detail}; retry later", code="overloaded")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")


def engine_sleeping(exc: BaseException) -> APIError:
    """A 503: the engine sleeps (sleep mode) until ``POST /wake_up``."""
    return APIError(503, str(exc), code="engine_sleeping")


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to the error the client should get."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(exc)
    if isinstance(exc, EngineSleepingError):
        return engine_sleeping(exc)
    if isinstance(exc, EngineBusyError):  # sleep mode's sleep with requests unfinished
        return APIError(409, str(exc), code="requests_unfinished")
    if isinstance(exc, RequestFailedError):
        # the engine ended this request alone: its own fault (400) or the engine's (500)
        status = 400 if exc.error.client_error else 500
        return APIError(status, exc.error.message, code="request_failed")
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    # A bug in the server: log the traceback here, send the client no internals.
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error (see the server log)", code="internal_error")


def stream_error_json(exc: BaseException) -> str:
    """The JSON of an error event sent inside an SSE stream (headers already went out, so
    the status travels as ``code`` when the error has no code of its own)."""
    error = to_api_error(exc)
    body = error.body()
    if body["error"]["code"] is None:
        body["error"]["code"] = error.status
    return json.dumps(body)


#: pydantic's names of the members of a union (``prompt.str``, ``prompt.list[int].0``,
#: ``tool_choice.dict[str,any]``): which alternative failed, not a field of the request
_UNION_MEMBER = re.compile(
    r"^(?:str|int|float|bool|bytes|dict|list|set|tuple|none|any|json|is-instance|url"
    r"|function-(?:after|before|wrap|plain)|literal|nullable|lax-or-strict)(?:\[.*\])?$"
)


def _field_path(loc: list[str]) -> str:
    """The request field a validation error's location points at: ``loc`` up to the first
    union member's name (``prompt.str`` -> ``prompt``, ``messages.0.content.list[...]`` ->
    ``messages.0.content``). The message keeps the full locations: they say what each
    alternative wanted."""
    kept: list[str] = []
    for part in loc:
        if _UNION_MEMBER.match(part):
            break
        kept.append(part)
    return ".".join(kept) or ".".join(loc)


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """A 400 naming every invalid field, from pydantic's (or FastAPI's JSON-decode) errors."""
    parts: list[str] = []
    first_param: str | None = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {err.get('msg', 'invalid JSON')}")
        if not loc and isinstance(err.get("input"), str | bytes):
            # FastAPI left the body unparsed: its Content-Type is not JSON (e.g. curl -d's
            # form type)
            return APIError(
                400,
                "the request body must be a JSON object sent with Content-Type: "
                "application/json (or with no Content-Type)",
            )
        where = ".".join(loc)
        if first_param is None and where:
            first_param = _field_path(loc)
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    message = "; ".join(parts) or "invalid request"
    return APIError(400, message, param=first_param)


# Each handler is registered for its own exception type only (install_exception_handlers).


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_to_api_error(exc).response()


async def _http_exception_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    code = "request_too_large" if exc.status_code == 413 else None
    error = APIError(exc.status_code, message, code=code)
    return error.response(headers=getattr(exc, "headers", None))


async def _value_error_handler(request: Request, exc: ValueError) -> JSONResponse:
    return from_value_error(exc).response()


async def _engine_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return to_api_error(exc).response()


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    return to_api_error(exc).response()


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every exception into OpenAI's error shape."""
    app.add_exception_handler(APIError, _api_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)  # type: ignore[arg-type]
    app.add_exception_handler(ValueError, _value_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(EngineDeadError, _engine_error_handler)
    app.add_exception_handler(EngineOverloadedError, _engine_error_handler)
    app.add_exception_handler(EngineSleepingError, _engine_error_handler)
    app.add_exception_handler(EngineBusyError, _engine_error_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
