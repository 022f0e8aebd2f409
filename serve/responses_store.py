"""The in-memory store of ``/v1/responses`` (``store: true``, the default): what
``GET /v1/responses/{id}`` returns and what ``previous_response_id`` continues.

Bounded, least recently used first out: a server that runs for days keeps at most
``max_responses`` (:data:`DEFAULT_MAX_STORED_RESPONSES`, or ``$CHASSIS_RESPONSES_STORE_SIZE``)
responses, and a conversation continued now and then stays (a background response enters
it when it finishes: while it runs it is in :mod:`chassis.serve.responses_background`, never
dropped). A stored background response that streamed keeps its event log (an event per
output delta, a few hundred bytes each) for ``GET ...?stream=true``: at most
``max_events_per_response`` newest events each
(:data:`~chassis.serve.responses_events.DEFAULT_MAX_EVENTS_PER_RESPONSE`, or
``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE``), the bound it had while it ran
(:class:`~chassis.serve.responses_events.EventLog`); the store keeps at most ``max_events``
(:data:`DEFAULT_MAX_STORED_EVENTS`) such events in all, dropping the least recently used
responses' logs first (the responses themselves stay). A response's output
logprobs (``include: ["message.output_text.logprobs"]``) cost about 330 bytes per entry (a
token or one of its ``top_logprobs``; ``python tests/perf/responses_logprob_memory.py``), up
to 20 times the text's size: the store keeps at most
``max_logprobs`` (:data:`DEFAULT_MAX_STORED_LOGPROBS`) such entries in all, dropping the least
recently used responses beyond it (the newest always stays); a streamed background
response's event log counts its copies of them. Nothing survives a restart, and
several server processes do not share it (as vLLM's store).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from chassis.serve.responses_events import (
    EventLog,
    events_per_response_from_env,
    positive_int_from_env,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

#: Responses kept when ``$CHASSIS_RESPONSES_STORE_SIZE`` is not set.
DEFAULT_MAX_STORED_RESPONSES = 1024
STORE_SIZE_ENV = "CHASSIS_RESPONSES_STORE_SIZE"
#: Stream events kept in all by the store's responses (a few hundred megabytes); without a
#: bound, 1024 stored responses of thousands of tokens each would hold gigabytes.
DEFAULT_MAX_STORED_EVENTS = 1_000_000
#: Output logprob entries (each token's and each of its alternatives) kept in all by the
#: store's responses (about 314 MiB as JSON dicts: ``python
#: tests/perf/responses_logprob_memory.py``); without a bound, 1024 stored responses of 4,000
#: tokens with ``top_logprobs: 20`` (about 6.9 kB each) would hold tens of gigabytes.
DEFAULT_MAX_STORED_LOGPROBS = 1_000_000
#: Copies of each output logprob entry in a streamed background response's event log (its
#: ``response.output_text.delta``, then ``response.output_text.done``,
#: ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``),
#: counted towards ``max_logprobs`` with the response's own.
EVENT_COPIES_OF_LOGPROBS = 5


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its JSON (``response``) and the conversation it ends
    (``conversation``: the input items of every turn, then this turn's output items; the
    ``instructions`` are not part of it, as OpenAI does not carry them over).

    ``num_input_items``: how many of the conversation's items were the model's input
    (``None``: all); ``events``: the stream events of a background response created with
    ``stream: true`` (kept for ``GET ...?stream=true``; its newest events only), else
    ``None``; ``events_dropped``: it had such events, and the store's bound on events dropped
    them; ``num_logprobs``: its output's logprob entries, alternatives included
    (:func:`count_logprobs`), times
    ``1 + EVENT_COPIES_OF_LOGPROBS`` when it keeps events."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    num_input_items: int | None = None
    events: EventLog | None = None
    events_dropped: bool = False
    num_logprobs: int = 0

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """The items the model was given (``GET /v1/responses/{id}/input_items``)."""
        if self.num_input_items is None:
            return self.conversation
        return self.conversation[: self.num_input_items]


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them (the least recently stored or
    read goes first), at most ``max_events`` stream events in all (the least recently
    used responses' event logs go first) and at most ``max_logprobs`` output logprob entries
    in all (the least recently used responses go first, never the one just stored). Used
    from the event loop only: no locking.

    ``max_events_per_response`` (``None``: ``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE`` or
    :data:`~chassis.serve.responses_events.DEFAULT_MAX_EVENTS_PER_RESPONSE`) bounds each
    streamed background response's event log from its start (:meth:`new_event_log`), while
    it runs and once stored."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
        max_events: int = DEFAULT_MAX_STORED_EVENTS,
        max_logprobs: int = DEFAULT_MAX_STORED_LOGPROBS,
        max_events_per_response: int | None = None,
    ) -> None:
        if max_responses < 1:
            raise ValueError(f"the responses store needs room for 1 or more; got {max_responses}")
        if max_events_per_response is None:
            max_events_per_response = events_per_response_from_env()
        self.max_responses = max_responses
        self.max_events = max_events
        self.max_logprobs = max_logprobs
        self.max_events_per_response = max_events_per_response
        EventLog(max_events_per_response)  # a bound below 1 is a ValueError now
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_events(self) -> int:
        """The stream events the stored responses hold. Counted, not tracked: a background
        response is stored just before its last events are logged (the log is shared)."""
        return sum(len(stored.events) for stored in self._items.values() if stored.events)

    def new_event_log(self) -> EventLog:
        """An empty event log for a streamed background response, bounded by
        ``max_events_per_response``."""
        return EventLog(self.max_events_per_response)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored`` under ``response_id``, dropping the least recently used beyond
        the bounds (whole responses beyond ``max_responses`` or ``max_logprobs``, then event
        logs beyond ``max_events``)."""
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)
        num_logprobs = sum(kept.num_logprobs for kept in self._items.values())
        while num_logprobs > self.max_logprobs and len(self._items) > 1:
            _, dropped = self._items.popitem(last=False)  # never the newest, ``stored``
            num_logprobs -= dropped.num_logprobs
        excess = self.num_events - self.max_events
        for key, kept in list(self._items.items()):  # least recently used first
            if excess <= 0:
                break
            if kept.events:
                excess -= len(kept.events)
                # its log's copies of its logprobs go with it
                own = kept.num_logprobs // (1 + EVENT_COPIES_OF_LOGPROBS)
                self._items[key] = replace(kept, events=None, events_dropped=True, num_logprobs=own)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response stored under ``response_id`` (now the most recently used), or
        ``None``."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; whether it was stored."""
        return self._items.pop(response_id, None) is not None


def count_logprobs(output: list[dict[str, Any]]) -> int:
    """The logprob entries of ``output`` (output items as JSON): one per token of each
    ``output_text`` part, plus one per alternative in its ``top_logprobs``."""
    return sum(
        1 + len(entry.get("top_logprobs") or [])
        for item in output
        if isinstance(item.get("content"), list)
        for part in item["content"]
        if isinstance(part, dict)
        for entry in part.get("logprobs") or []
    )


def store_size_from_env() -> int:
    """``$CHASSIS_RESPONSES_STORE_SIZE``, else :data:`DEFAULT_MAX_STORED_RESPONSES`;
    ``ValueError`` for a value that is not a positive integer."""
    return positive_int_from_env(STORE_SIZE_ENV, DEFAULT_MAX_STORED_RESPONSES)


def response_store(app: FastAPI) -> ResponseStore:
    """The app's store, ``app.state.responses_store`` (made by
    :func:`~chassis.serve.app.build_app`, which an embedding application or a test may
    replace; made here on first use for an app built otherwise)."""
    store = getattr(app.state, "responses_store", None)
    if store is None:
        store = ResponseStore(store_size_from_env())
        app.state.responses_store = store
    return store
