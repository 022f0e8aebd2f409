"""Two of vLLM's server options, as ASGI middleware (no ``BaseHTTPMiddleware``: it would
buffer streamed responses):

* :class:`RequestIdHeaderMiddleware` (``--enable-request-id-headers``): every response
  carries ``X-Request-Id``, the request's own header or a new random id, error responses
  (401, 413, ...) included.
* :class:`ServerLoadMiddleware` (``--enable-server-load-tracking``): counts the API requests
  being served, a streamed one until its last event is sent; ``GET /load`` reports the count
  as ``{"server_load": N}`` (vLLM's route and shape; without the flag the route does not
  exist).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.routing import get_route_path

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the POST routes whose requests count as load (those that run the engine)
LOAD_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/classify",
        "/pooling",
        "/invocations",
    }
)


class RequestIdHeaderMiddleware:
    """Adds ``X-Request-Id`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (
            next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
            or uuid.uuid4().hex.encode()
        )

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """The number of API requests being served (``app.state.server_load``)."""

    def __init__(self) -> None:
        self.count = 0


class ServerLoadMiddleware:
    """Counts the requests to :data:`LOAD_PATHS` in :class:`ServerLoad` while they are
    served (the app's call returns once the whole response, a stream included, is sent or
    the client is gone)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracked = (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and get_route_path(scope) in LOAD_PATHS
        )
        if not tracked:
            await self.app(scope, receive, send)
            return
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


async def server_load(request: Request) -> JSONResponse:
    """``GET /load``: ``{"server_load": N}``, the API requests being served."""
    return JSONResponse({"server_load": request.app.state.server_load.count})
