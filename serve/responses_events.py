"""The event log of a streamed background response, bounded per response.

A background response created with ``stream: true`` keeps its stream events so that a client
may follow it again from any sequence number (``GET /v1/responses/{id}?stream=true&
starting_after=N``). A long response makes an event per output delta, so while it runs its
log would grow with its length: :class:`EventLog` keeps only the newest ``max_events``
(:data:`DEFAULT_MAX_EVENTS_PER_RESPONSE`, or ``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE``),
dropping the oldest. Sequence numbers stay those the events were sent with: the log knows
the number of its oldest event (:attr:`EventLog.first`), and a resume that asks for events
before it is refused (:class:`EventsDropped`) rather than answered with a gap. The newest
events, the response's end among them, are always kept. Once the response is stored, the
store's bound on events in all (:mod:`chassis.serve.responses_store`) applies on top.

A connected follower holds its place (:meth:`EventLog.hold`): an event it has yet to read
is kept beyond the bound, so a client that reads more slowly than the engine writes, or
that resumed from the oldest kept event of a running response, gets every event, late. That
slack is bounded too: the log never keeps more than twice ``max_events``
(:attr:`EventLog.max_kept`). A follower further behind than that (a client that stopped
reading but keeps its connection open) loses its place: its stream ends with an ``error``
event (code ``events_dropped``, :meth:`EventLog.dropped_event`) that says from where it may
resume, and the server does not keep a stalled client's backlog. A client that gets it
resumes (OpenAI's cursor, ``starting_after``) from the oldest kept event, or retrieves the
response whole without ``stream``.
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Iterator
from itertools import islice

#: Events kept per streamed background response when ``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE``
#: is not set: an event per output delta, so the last ~10,000 tokens' deltas and the final
#: events of any response.
DEFAULT_MAX_EVENTS_PER_RESPONSE = 10_000
EVENTS_PER_RESPONSE_ENV = "CHASSIS_RESPONSES_EVENTS_PER_RESPONSE"


class EventsDropped(Exception):
    """A resume asked for events the log no longer keeps; ``first`` is the sequence number
    of the oldest event it keeps."""

    def __init__(self, starting_after: int, first: int, max_events: int) -> None:
        self.first = first
        super().__init__(
            f"the stream events before sequence number {first} were dropped (the server keeps "
            f"the last {max_events} events of a response): resume with starting_after "
            f"{first - 1} or more, or retrieve the response without stream; got "
            f"starting_after {starting_after}"
        )


class EventsBeyondEnd(Exception):
    """A resume named a sequence number no event of the log has yet: a client can only
    resume after an event it was sent, so this is a bad ``starting_after``."""

    def __init__(self, starting_after: int, end: int) -> None:
        last = "none was sent yet" if end == 0 else f"the last one sent is {end - 1}"
        super().__init__(
            f"starting_after {starting_after} is beyond this response's stream events "
            f"({last}): resume with the sequence number of the last event received"
        )


class EventLog:
    """The newest ``max_events`` events of one stream (SSE strings), by sequence number: the
    event appended ``k``-th (from 0) has sequence number ``k`` whether or not it is still
    kept. Appending past ``max_events`` drops the oldest, except those a live follower still
    has to read (:meth:`hold`): the log keeps more than ``max_events`` while one is behind,
    up to :attr:`max_kept`; past that the oldest go even when held, and a follower whose
    next event went finds its place below :attr:`first` (it then ends with
    :meth:`dropped_event`)."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS_PER_RESPONSE) -> None:
        if max_events < 1:
            raise ValueError(f"an event log needs room for 1 event or more; got {max_events}")
        self.max_events = max_events
        self._events: deque[str] = deque()
        #: the sequence number of the oldest kept event (of the next one when none is kept)
        self.first = 0
        #: the next sequence number of each live follower (how many hold each)
        self._held: Counter[int] = Counter()

    def __len__(self) -> int:
        """The events kept (not the events appended)."""
        return len(self._events)

    def __iter__(self) -> Iterator[str]:
        """The kept events, oldest first."""
        return iter(self._events)

    @property
    def max_kept(self) -> int:
        """The most events the log keeps, followers' holds included: twice ``max_events``
        (a follower may be up to ``max_events`` behind the oldest event a resume may
        start from)."""
        return 2 * self.max_events

    @property
    def end(self) -> int:
        """The sequence number the next appended event gets."""
        return self.first + len(self._events)

    def append(self, event: str) -> None:
        """Keep ``event`` (sequence number :attr:`end`), dropping the oldest beyond the
        bound that no follower holds."""
        self._events.append(event)
        self._trim()

    def hold(self, sequence_number: int) -> None:
        """A live follower is to read ``sequence_number`` next: keep it, and every later
        event, until :meth:`release`."""
        self._held[sequence_number] += 1

    def release(self, sequence_number: int) -> None:
        """Undo one :meth:`hold` of ``sequence_number``, dropping what no longer needs
        keeping."""
        self._held[sequence_number] -= 1
        if self._held[sequence_number] <= 0:
            del self._held[sequence_number]
        self._trim()

    def _trim(self) -> None:
        floor = min(self._held, default=self.end)
        while len(self._events) > self.max_events and (
            self.first < floor or len(self._events) > self.max_kept
        ):
            self._events.popleft()
            self.first += 1

    def dropped_event(self, sequence_number: int) -> str:
        """The ``error`` event that ends a live follower whose next event, the one of
        ``sequence_number``, was dropped (it fell more than :attr:`max_kept` events behind).
        It carries that sequence number: the events it missed were never sent to it."""
        error = EventsDropped(sequence_number - 1, self.first, self.max_events)
        data = {
            "type": "error",
            "sequence_number": sequence_number,
            "code": "events_dropped",
            "message": f"this stream fell more than {self.max_kept} events behind: {error}",
            "param": None,
        }
        return f"event: error\ndata: {json.dumps(data)}\n\n"

    def check_resume(self, starting_after: int) -> None:
        """:class:`EventsDropped` unless every event after ``starting_after`` is kept or
        still to come."""
        if starting_after + 1 < self.first:
            raise EventsDropped(starting_after, self.first, self.max_events)

    def check_complete_resume(self, starting_after: int) -> None:
        """:meth:`check_resume` for a log no event will be added to (its response has
        finished): also :class:`EventsBeyondEnd` when ``starting_after`` is above its last
        event (the stream would be empty forever). A running response's follower may wait
        for events still to come, so :meth:`check_resume` allows that."""
        if starting_after >= self.end:
            raise EventsBeyondEnd(starting_after, self.end)
        self.check_resume(starting_after)

    def get(self, sequence_number: int) -> str:
        """The kept event of ``sequence_number``; :class:`EventsDropped` for a dropped one,
        ``IndexError`` for one not appended yet."""
        if sequence_number < self.first:
            raise EventsDropped(sequence_number - 1, self.first, self.max_events)
        if sequence_number >= self.end:
            raise IndexError(f"no event {sequence_number} yet (next is {self.end})")
        return self._events[sequence_number - self.first]

    def after(self, starting_after: int) -> list[str]:
        """The events after sequence number ``starting_after`` (all of them for -1);
        :class:`EventsDropped` when some of them are no longer kept, :class:`EventsBeyondEnd`
        when ``starting_after`` is above the last event (meant for a finished response's
        log: :meth:`check_complete_resume`)."""
        self.check_complete_resume(starting_after)
        skip = max(starting_after + 1 - self.first, 0)
        return list(islice(self._events, skip, None))


def events_per_response_from_env() -> int:
    """``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE``, else
    :data:`DEFAULT_MAX_EVENTS_PER_RESPONSE`; ``ValueError`` for a value that is not a
    positive integer."""
    return positive_int_from_env(EVENTS_PER_RESPONSE_ENV, DEFAULT_MAX_EVENTS_PER_RESPONSE)


def positive_int_from_env(name: str, default: int) -> int:
    """``$name`` as an integer, ``default`` when it is unset or blank; ``ValueError`` naming
    the variable for a value that is not a positive integer."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"${name} must be a positive integer; got {raw!r}")
    return size
