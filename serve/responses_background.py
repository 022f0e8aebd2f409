"""Background responses (``background: true``): generation that outlives its HTTP request.

A background response runs as an ``asyncio`` task of the server (:class:`BackgroundRun`);
``POST /v1/responses`` answers at once with the response ``queued``. It is ``in_progress``
from the engine's first output, and ends ``completed``, ``incomplete``, ``failed`` or
``cancelled`` in the responses store (:mod:`chassis.serve.responses_store`), which requires
``store``. While it runs it lives here, not in the store: the store's bound never drops a
running response, and ``GET /v1/responses/{id}`` shows it with the output made so far.

Every event of the run (:mod:`chassis.serve.responses_stream`'s, with their
``sequence_number``) is logged in :attr:`BackgroundRun.events` when the request streamed, so
that a client may follow it (``stream: true``) and resume it from any sequence number after
a disconnect; the log keeps the newest events of the run only
(:class:`~chassis.serve.responses_events.EventLog`): a resume from before them is a 400. A
connected follower gets every event while it is at most
:attr:`~chassis.serve.responses_events.EventLog.max_kept` events behind the newest (the log
keeps those it has yet to read, up to that); one further behind ends with an ``error``
event (``events_dropped``) saying where it may resume.
Following never cancels the run; ``POST /v1/responses/{id}/cancel`` does
(:meth:`BackgroundResponses.cancel`: the task is cancelled, which closes the engine stream
and so aborts the engine request and frees its KV blocks). On server shutdown every run is
cancelled the same way (:meth:`BackgroundResponses.close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from chassis.serve.responses_events import EventLog
    from chassis.serve.responses_protocol import ResponseObject


@dataclass(eq=False)
class BackgroundRun:
    """One running background response.

    ``snapshot`` makes the response as it stands (status, output so far); ``events`` is the
    log of its stream events (``None``: not kept, the request did not stream), by
    ``sequence_number``.
    """

    response_id: str
    snapshot: Callable[[], ResponseObject]
    events: EventLog | None
    #: the items the model is given (``GET /v1/responses/{id}/input_items``)
    input_items: list[dict[str, Any]]
    #: ``queued`` until the engine's first output, then ``in_progress``
    status: str = "queued"
    done: bool = False
    task: asyncio.Task[None] | None = None
    #: :meth:`BackgroundResponses.cancel` was called (the work checks it when it starts: a
    #: task cancelled before its first step would run none of its clean-up)
    cancel_requested: bool = False
    started: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add_event(self, event: str) -> None:
        """Log ``event`` (when events are kept) and wake the followers."""
        if self.events is not None:
            self.events.append(event)
        self._notify()

    def finished(self) -> None:
        """The run ended (its last event, if any, is logged)."""
        self.done = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The logged events whose sequence number is above ``starting_after``, then each new
        one as it comes, until the run ends. Needs ``events``; raises
        :class:`~chassis.serve.responses_events.EventsDropped` when the log no longer keeps
        the first of them, :class:`~chassis.serve.responses_events.EventsBeyondEnd` when the
        run is done and ``starting_after`` is above its last event. The follower holds its
        place in the log from this call on (:meth:`EventLog.hold`, released when the stream
        ends, is closed or is collected unread): it gets every event unless it falls more
        than :attr:`EventLog.max_kept` events behind, when the stream ends with
        :meth:`EventLog.dropped_event`."""
        log = self.events
        assert log is not None
        if self.done:  # no event is to come
            log.check_complete_resume(starting_after)
        else:
            log.check_resume(starting_after)
        place = _Place(log, starting_after + 1)
        stream = self._follow(place)
        # a stream never started runs no finally: release when it is collected, on the loop
        # (the collection may happen in any thread; the log is the event loop's)
        weakref.finalize(stream, _release_soon, asyncio.get_running_loop(), place)
        return stream

    async def _follow(self, place: _Place) -> AsyncIterator[str]:
        log = place.log
        try:
            while True:
                while place.index < log.end:
                    if place.index < log.first:  # fell too far behind: its events went
                        yield log.dropped_event(place.index)
                        return
                    event = log.get(place.index)
                    place.advance()
                    yield event
                if self.done:
                    return
                await self._changed.wait()
        finally:
            place.release()


def _release_soon(loop: asyncio.AbstractEventLoop, place: _Place) -> None:
    # a closed loop (RuntimeError) has nothing reading the log any more
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(place.release)


class _Place:
    """A follower's place in an event log: the sequence number it reads next, held
    (:meth:`EventLog.hold`) until :meth:`release`."""

    def __init__(self, log: EventLog, index: int) -> None:
        self.log = log
        self.index = index
        self._held = True
        log.hold(index)

    def advance(self) -> None:
        """The event at :attr:`index` was read: hold the next one instead."""
        self.log.hold(self.index + 1)
        self.log.release(self.index)
        self.index += 1

    def release(self) -> None:
        """Let the log drop what this follower has yet to read (once; later calls do
        nothing)."""
        if self._held:
            self._held = False
            self.log.release(self.index)


class BackgroundResponses:
    """The running background responses of one app, by response id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        """The run of ``response_id`` while it runs, else ``None``."""
        return self._runs.get(response_id)

    def start(self, run: BackgroundRun, work: Callable[[BackgroundRun], Awaitable[None]]) -> None:
        """Run ``work(run)`` as a task; the run is listed until ``work`` returns (it must
        store the final response itself, and handle its own cancellation: a
        ``CancelledError``, or ``run.cancel_requested`` when it starts)."""

        async def main() -> None:
            run.started = True
            try:
                await work(run)
            finally:
                self._runs.pop(run.response_id, None)
                run.finished()

        self._runs[run.response_id] = run
        # the set of runs holds the task: the loop keeps only a weak reference
        run.task = asyncio.ensure_future(main())

    async def cancel(self, response_id: str) -> bool:
        """Cancel the run of ``response_id`` and wait until it has ended (its engine request
        aborted, its final response stored); whether it was running."""
        run = self._runs.get(response_id)
        if run is None or run.task is None:
            return False
        await self._cancel([run])
        return True

    async def close(self) -> None:
        """Cancel every run and wait for them (server shutdown)."""
        await self._cancel(list(self._runs.values()))

    @staticmethod
    async def _cancel(runs: list[BackgroundRun]) -> None:
        tasks = [run.task for run in runs if run.task is not None]
        for run in runs:
            run.cancel_requested = True
            if run.started and run.task is not None:
                run.task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def background_responses(app: FastAPI) -> BackgroundResponses:
    """The app's runs, ``app.state.responses_background`` (made on first use)."""
    runs = getattr(app.state, "responses_background", None)
    if runs is None:
        runs = BackgroundResponses()
        app.state.responses_background = runs
    return runs
