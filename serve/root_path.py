"""``--root-path``: serve the app behind a reverse proxy that adds a path prefix.

:class:`RootPathMiddleware` sets the ASGI ``root_path`` of every request to the prefix, as
FastAPI's own ``root_path`` argument did before it was deprecated (and as vLLM's
``--root-path`` does). Starlette then routes a path with or without the prefix (a proxy
that strips it and one that passes it on both work), and FastAPI's OpenAPI schema lists the
prefix as its server while ``/docs`` loads the schema from under it.

uvicorn's own ``root_path`` is not used: uvicorn prepends it to every request's path, so a
proxy that passes the prefix on would get 404s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


class RootPathMiddleware:
    """Sets ``scope["root_path"]`` of HTTP and WebSocket requests to ``root_path``."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
