"""The HTTP/1.1 implementation the server runs, with a bound on unfinished request heads.

uvicorn's httptools protocol (llhttp, in C) costs less per streamed chunk than its pure-Python
h11 one, but it has no setting that bounds how much of an unfinished request head it buffers:
a client could send an endless header line. :class:`BoundedHttpToolsProtocol` adds that bound:
once the bytes received inside one unfinished head exceed ``max_head_bytes``, the client gets
a 431 in OpenAI's error shape and the connection is closed. What is buffered by then is at
most ``max_head_bytes`` plus two reads (asyncio reads up to 256 KiB at a time): the one the
head began in, which is not counted, and the one that crossed the bound. A head that does arrive whole is measured exactly by
:class:`~chassis.serve.security.RequestSizeLimitMiddleware`.

Without httptools installed the server falls back to h11 with
``h11_max_incomplete_event_size``, which bounds the same thing (uvicorn answers 400 there).

The subclass leans on uvicorn internals: the parser callbacks ``on_message_begin`` and
``on_headers_complete``, ``data_received``, and the ``transport`` and ``cycle`` attributes.
A uvicorn release that renames them breaks
``tests/test_server_lifecycle.py::test_oversized_headers_are_refused_by_the_real_server``,
which drives a real server with a head that never ends.
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


def head_too_large_response(max_head_bytes: int) -> bytes:
    """The raw HTTP/1.1 431 response (closing the connection) for an oversized head."""
    error = APIError(
        431,
        f"request headers exceed the server's limit of {max_head_bytes} bytes (--max-header-size)",
        code="request_headers_too_large",
        type="invalid_request_error",
    )
    body = json.dumps(error.body()).encode()
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol that refuses request heads over ``max_head_bytes``.

        Bytes count toward a head when the read that brought them began inside that
        unfinished head, so a head is never over-counted (a pipelined head that begins
        mid-read is under-counted by at most that read).
        """

        max_head_bytes: int = 64 * 1024

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = False
            self._head_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > self.max_head_bytes:
                self._refuse_head()

        def _refuse_head(self) -> None:
            self._in_head = False
            if self.transport.is_closing():
                return
            # Only answer when no response of this connection is under way (a pipelined
            # head arriving while one streams): a 431 written then would corrupt it.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(head_too_large_response(self.max_head_bytes))
            self.transport.close()

else:  # pragma: no cover - httptools is a dependency; this is the fallback's name only
    BoundedHttpToolsProtocol = None  # type: ignore[assignment,misc]
