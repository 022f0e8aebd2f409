"""The HTTP/1.1 implementation the server runs, with the bounds h11 had.

uvicorn's httptools protocol (llhttp, in C) costs less per streamed chunk than its pure-Python
h11 one, but it has no setting that bounds what it buffers of a request: a client could send
an endless header line, or an endless chunked trailer. :class:`BoundedHttpToolsProtocol`
adds the bounds (its docstring lists them): an unfinished head past ``max_head_bytes`` gets a
431 in OpenAI's error shape, as much received after the head without a byte of body closes
the connection, and a request asking to switch protocols (``Upgrade: h2c``, whose body
httptools would drop) gets a 400. What is buffered before a refusal is at most
``max_head_bytes`` plus two reads (asyncio reads up to 256 KiB at a time). A head that does
arrive whole is measured exactly by :class:`~chassis.serve.security.RequestSizeLimitMiddleware`.

Without httptools installed the server falls back to h11 with
``h11_max_incomplete_event_size``, which bounds the same thing (uvicorn answers 400 there).

The subclass leans on uvicorn internals: the parser callbacks (``on_message_begin``,
``on_headers_complete``, ``on_body``, ``on_message_complete``), ``data_received``, and the
``headers``, ``transport``, ``cycle`` and ``logger`` attributes. A uvicorn release that
changes them fails ``tests/test_http_protocol.py`` and
``tests/test_server_lifecycle.py::test_oversized_headers_are_refused_by_the_real_server``.
"""

from __future__ import annotations

import json
from typing import Any

from chassis.serve.errors import APIError

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def http_config(max_head_bytes: int) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that select the HTTP protocol: httptools with the
    head bound when it is installed, else h11 with its own bound."""
    if HttpToolsProtocol is None:
        return {"http": "h11", "h11_max_incomplete_event_size": max_head_bytes}
    protocol = type(
        "BoundedHttpTools", (BoundedHttpToolsProtocol,), {"max_head_bytes": max_head_bytes}
    )
    return {"http": protocol}


def _raw_error(status: int, reason: bytes, error: APIError) -> bytes:
    """A raw HTTP/1.1 response carrying ``error`` in OpenAI's shape, closing the connection."""
    body = json.dumps(error.body()).encode()
    return (
        b"HTTP/1.1 " + str(status).encode() + b" " + reason + b"\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


def head_too_large_response(max_head_bytes: int) -> bytes:
    """The raw HTTP/1.1 431 response (closing the connection) for an oversized head."""
    error = APIError(
        431,
        f"request headers exceed the server's limit of {max_head_bytes} bytes (--max-header-size)",
        code="request_headers_too_large",
        type="invalid_request_error",
    )
    return _raw_error(431, b"Request Header Fields Too Large", error)


def upgrade_refused_response(protocol: str) -> bytes:
    """The raw 400 for a request that asks to switch protocols (``Upgrade: h2c``, what
    ``curl --http2`` sends over plain HTTP): httptools would stop parsing at the upgrade and the
    body would be lost, so the request is refused instead of being served without it."""
    error = APIError(
        400,
        f"this server speaks HTTP/1.1 and does not switch to {protocol!r}: send the request "
        "without an Upgrade header (curl: --http1.1)",
        code="upgrade_not_supported",
        type="invalid_request_error",
    )
    return _raw_error(400, b"Bad Request", error)


if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol with the bounds h11 had.

        - **Unfinished head** over ``max_head_bytes``: 431 and close. Bytes count toward a
          head when the read that brought them began inside that unfinished head, so a head
          is never over-counted (a pipelined head that begins mid-read is under-counted by at
          most that read).
        - **A body that stops making progress**: after the head, more than ``max_head_bytes``
          received without a byte of body (an endless chunk-size line, chunk extension or
          trailer, which httptools would buffer without limit): the connection is closed.
          Any body byte resets the count, so a body sent in tiny chunks is fine.
        - **A request that asks to switch protocols** (other than to WebSocket, which this
          server does not serve either): 400 and close, before the app sees it.
        """

        max_head_bytes: int = 64 * 1024

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = False
            self._head_bytes = 0
            self._in_body = False
            self._body_received = 0
            self._stalled_bytes = 0
            self._refused = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            upgrade = next((v for k, v in self.headers if k == b"upgrade"), None)
            if upgrade is not None and upgrade.lower() != b"websocket":
                self._refuse(upgrade_refused_response(upgrade.decode("latin-1")))
                return
            self._in_body = True
            self._stalled_bytes = 0
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._refused:
                return
            self._body_received += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_body = False
            if self._refused:
                return
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            in_body, body_before = self._in_body, self._body_received
            super().data_received(data)
            if self._refused:
                return
            if self._in_head and self._head_bytes > self.max_head_bytes:
                self._refuse(head_too_large_response(self.max_head_bytes))
            elif in_body and self._in_body:
                if self._body_received == body_before:
                    self._stalled_bytes += len(data)
                else:
                    self._stalled_bytes = 0
                if self._stalled_bytes > self.max_head_bytes:
                    self.logger.warning(
                        "closing a connection whose request sent %d bytes without body "
                        "progress (an endless chunk header or trailer?)",
                        self._stalled_bytes,
                    )
                    self._refused = True
                    self.transport.close()  # the app sees a disconnect

        def _refuse(self, response: bytes) -> None:
            self._in_head = self._in_body = False
            self._refused = True
            if self.transport.is_closing():
                return
            # Only answer when no response of this connection is under way (a pipelined
            # request arriving while one streams): writing one then would corrupt it.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(response)
            self.transport.close()

else:  # pragma: no cover - httptools is a dependency; this is the fallback's name only
    BoundedHttpToolsProtocol = None  # type: ignore[assignment,misc]
