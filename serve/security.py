"""The server's edge: API-key authentication, CORS, and a bound on request bodies.

All three are plain ASGI middleware (no ``BaseHTTPMiddleware``, which would buffer streamed
responses and break disconnect detection). Order, outermost first: CORS (so a browser's
preflight is answered without a key, and errors carry CORS headers), the API key, the size
bounds, then the app.

* **API key** (``--api-key`` / ``CHASSIS_API_KEY``): every route needs
  ``Authorization: Bearer <key>`` except ``/health`` and ``/ping`` (load balancers and
  SageMaker probe them) and, when
  ``metrics_require_auth`` is off, ``/metrics``. The comparison is constant-time
  (``hmac.compare_digest``). A miss is a 401 in OpenAI's error shape.
* **CORS**: off unless ``--allowed-origins`` is given.
* **Request size**: headers (with the request target) over ``--max-header-size`` get 431; a
  ``Content-Length`` over ``--max-request-body-size`` is refused before the body is read, and
  a chunked body is counted as it arrives: 413. uvicorn's h11 parser bounds how much of an
  unfinished request head it buffers (see :mod:`chassis.serve.server`).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import get_route_path

from chassis.serve.errors import APIError

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from chassis.serve.settings import ServerSettings

#: Paths that never need the API key.
ALWAYS_OPEN_PATHS = frozenset({"/health", "/ping"})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _send_error(send: Send, error: APIError, headers: dict[str, str] | None = None) -> None:
    response = error.response(headers=headers)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})


class APIKeyMiddleware:
    """Rejects requests without ``Authorization: Bearer <api_key>`` (401)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self.open_paths = open_paths

    def authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        # compare_digest on the token even when the scheme is wrong: no early exit to time.
        ok = hmac.compare_digest(token.strip(), self._key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the path without --root-path's prefix, which a proxy may or may not strip
        path = get_route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in self.open_paths or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        await _send_error(send, error, headers={"WWW-Authenticate": "Bearer"})


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body exceeds the server's limit of {limit} bytes (--max-request-body-size)",
        code="request_too_large",
    )


def _header_bytes(scope: Scope) -> int:
    """The size of the request line's target plus headers, as they came on the wire."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return size + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))  # ": " + CRLF


class RequestSizeLimitMiddleware:
    """Refuses headers over ``max_header_bytes`` (431) and bodies over ``max_body_bytes`` (413).

    uvicorn's h11 bound only applies while a request head is incomplete in its buffer (one
    read is up to 256 KiB), so the exact header bound is enforced here.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _header_bytes(scope) > self.max_header_bytes:
            error = APIError(
                431,
                f"request headers exceed the server's limit of {self.max_header_bytes} bytes "
                "(--max-header-size)",
                code="request_headers_too_large",
                type="invalid_request_error",
            )
            await _send_error(send, error)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, APIError(400, "invalid Content-Length header"))
                return
            if size > self.max_body_bytes:
                await _send_error(send, _too_large(self.max_body_bytes))
                return
        received = 0
        limit = self.max_body_bytes

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises HTTPException from body reading; our handler shapes it.
                    raise HTTPException(status_code=413, detail=_too_large(limit).message)
            return message

        await self.app(scope, counting_receive, send)


def install_security(app: FastAPI, settings: ServerSettings) -> None:
    """Add the body bound, the API-key check and CORS to ``app`` as ``settings`` ask."""
    app.add_middleware(
        RequestSizeLimitMiddleware,
        max_body_bytes=settings.max_request_body_bytes,
        max_header_bytes=settings.max_header_bytes,
    )
    if settings.api_key is not None:
        open_paths = set(ALWAYS_OPEN_PATHS)
        if not settings.metrics_require_auth:
            open_paths.add("/metrics")
        app.add_middleware(
            APIKeyMiddleware, api_key=settings.api_key, open_paths=frozenset(open_paths)
        )
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
        )
