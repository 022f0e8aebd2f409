"""Server-sent events and the async plumbing around engine streams.

* :func:`sse` / :data:`SSE_DONE`: OpenAI's wire format, ``data: {json}\\n\\n`` events ending
  with ``data: [DONE]\\n\\n``.
* :class:`ClosingStreamingResponse`: an SSE response that closes its generator when done.
* :func:`merge_streams`: several engine streams (a batch of prompts) as one, items tagged
  with their stream's index, every stream closed when the merge is closed.
* :func:`cancel_on_disconnect`: runs a non-streaming handler while watching the client; a
  disconnect cancels the handler, whose ``aclosing`` blocks then close the engine streams,
  which aborts the requests in the engine (and frees their KV blocks).

Streaming responses need no watcher of their own: Starlette's ``StreamingResponse`` listens
for the disconnect and stops the body iterator, and :class:`ClosingStreamingResponse` closes
it, whose ``aclosing`` blocks do the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import JSONResponse, Response, StreamingResponse

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import Receive, Scope, Send

T = TypeVar("T")
S = TypeVar("S")

SSE_DONE = "data: [DONE]\n\n"


def sse(json_text: str) -> str:
    """One SSE event carrying ``json_text``."""
    return f"data: {json_text}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its body iterator when the response ends.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here runs its ``aclosing`` blocks at once, which aborts the
    engine requests behind it.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _next(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield ``(stream index, item)`` as items arrive from any of ``streams``.

    An exception from one stream propagates (after the others are closed). Closing or
    cancelling the merge closes every stream.
    """
    if len(streams) == 1:  # the common case needs no tasks
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    pending: dict[asyncio.Task[T], int] = {
        asyncio.ensure_future(_next(s)): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(_next(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first`` then the items of ``rest``; closing this closes ``rest``."""
    async with contextlib.aclosing(rest) as stream:  # type: ignore[type-var]
        yield first
        async for item in stream:
            yield item


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by the time a handler runs, so the next ASGI message is the
    # disconnect (servers send it when the client closes the connection).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    :class:`ClientDisconnected`."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let its aclosing blocks run
    raise ClientDisconnected


async def generation_response(
    request: Request,
    stream: bool,
    open_streams: Callable[[], Awaitable[S]],
    events: Callable[[S], AsyncIterator[str | bytes]],
    collect: Callable[[S], Awaitable[Any]],
) -> Response:
    """The shared shape of a generation route (completions, chat completions), and of the
    routes that never stream (beam search, embeddings: ``stream=False``, ``events``
    :func:`never_streamed`).

    Streaming: open the engine streams, then answer with SSE ``events``. Otherwise: open and
    ``collect`` them into one pydantic body (or a ready ``Response``) while watching the
    client. A client that leaves gets its requests aborted (499); other failures become
    OpenAI-shaped errors.
    """
    from chassis.serve import errors

    try:
        if stream:
            opened = await cancel_on_disconnect(request, open_streams())
            return ClosingStreamingResponse(
                events(opened),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )

        async def run() -> Any:
            return await collect(await open_streams())

        body = await cancel_on_disconnect(request, run())
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    except errors.APIError:
        raise
    except Exception as exc:
        raise errors.to_api_error(exc) from exc
    if isinstance(body, Response):  # a body that is not JSON (/v1/embeddings' "bytes")
        return body
    return JSONResponse(body.model_dump(mode="json"))


def never_streamed(_: object) -> AsyncIterator[str | bytes]:
    """The ``events`` of a :func:`generation_response` that is never asked to stream."""
    raise RuntimeError("this response is never streamed")
