"""Errors the engine raises to its callers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.core.request import RequestError


class EngineDeadError(RuntimeError):
    """The engine core process died or hit a fatal error; no request can complete.

    The API server maps it to HTTP 503.
    """


class EngineOverloadedError(RuntimeError):
    """The engine refuses new work for now (queue full or shutting down); HTTP 503."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode: its weights or KV cache are freed), so it cannot
    generate: the request was refused before anything ran. ``wake_up()`` makes it serve
    again; the API server maps it to HTTP 503."""


class EngineBusyError(RuntimeError):
    """The engine cannot do what was asked while requests are unfinished (sleep mode's
    ``sleep``); nothing was done. Retry once they have finished or been aborted. The API
    server maps it to HTTP 409."""


class RequestFailedError(RuntimeError):
    """The engine core ended this request alone because of a fault in it (its
    structured-output constraint exceeded its work budget, or its matcher raised; its LoRA
    adapter id was taken by another folder, or its adapter cannot be loaded any more);
    other requests were not affected. ``error`` says why; the API server maps it to HTTP 400 when
    ``error.client_error``, else 500, with ``error.message``."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class RankExitedError(RuntimeError):
    """A tensor-parallel rank's worker process exited (killed, crashed) while the group
    needed it; the group is broken. Its message is one line written for clients too:
    which rank, its exit code and the command it was in (no stack, no path), which the
    engine core passes on whole when it dies of it
    (:func:`~chassis.core.engine_core_proc.crash_message_for_clients`)."""


def request_failure(error: RequestError) -> RequestFailedError | EngineSleepingError:
    """What a front-end raises for a request the engine core ended with ``error``:
    :class:`EngineSleepingError` when the engine was asleep, else
    :class:`RequestFailedError`."""
    if error.engine_sleeping:
        return EngineSleepingError(error.message)
    return RequestFailedError(error)
