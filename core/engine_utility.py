"""Utility calls: the front-end asks the engine core to run one of its methods between steps.

A call names a method of :class:`~chassis.core.engine_core.EngineCore` from
:data:`UTILITY_METHODS` (nothing else can be reached over the socket) with msgpack-able
arguments; the engine core answers with a :class:`UtilityResult` carrying the call's id and
its return value, or the error it raised as text (the engine keeps serving either way; the
front-end raises :data:`RELAYED_ERRORS` again as themselves, any other as ``RuntimeError``).
``LLM`` runs the engine core in its own process and calls the methods directly.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from chassis.core.errors import EngineBusyError

logger = logging.getLogger(__name__)

#: the engine-core methods a utility call may run
UTILITY_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "sleep",
        "sleep_progress",
        "wake_up",
        "is_sleeping",
        "pause",
        "pause_drained",
        "resume",
        "is_paused",
    }
)
#: errors the front-end raises again as themselves (their messages are written for
#: clients); any other error of a utility reaches it as a ``RuntimeError``
RELAYED_ERRORS: dict[str, type[Exception]] = {"EngineBusyError": EngineBusyError}


class UtilityCall(msgspec.Struct, kw_only=True):
    """Front-end -> engine core: run ``method(*args)``; ``call_id`` matches the answer."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Engine core -> front-end: the return value of call ``call_id``, or its ``error``."""

    call_id: int
    result: Any = None
    #: ``"<ExceptionType>: <message>"`` when the method raised (or is not a utility)
    error: str | None = None
    #: the raised error's type name (``EngineBusyError``): :data:`RELAYED_ERRORS` are raised
    #: again as themselves by the front-end
    error_type: str | None = None


def run_utility(core: Any, call: UtilityCall) -> UtilityResult:
    """Run ``call`` on ``core``; an unknown method or a raised error becomes ``error``."""
    if call.method not in UTILITY_METHODS:
        return UtilityResult(
            call_id=call.call_id,
            error=f"ValueError: {call.method!r} is not an engine utility; known: "
            f"{sorted(UTILITY_METHODS)}",
        )
    try:
        return UtilityResult(call_id=call.call_id, result=getattr(core, call.method)(*call.args))
    except Exception as exc:  # the caller gets it; the engine keeps serving
        kind = type(exc).__name__
        if kind in RELAYED_ERRORS:  # a refusal the caller acts on, not a failure
            logger.warning("engine utility %s refused: %s", call.method, exc)
        else:
            logger.exception("engine utility %s failed", call.method)
        return UtilityResult(call_id=call.call_id, error=f"{kind}: {exc}", error_type=kind)


def utility_error(answer: UtilityResult) -> Exception:
    """The exception the caller of a failed utility call gets: one of
    :data:`RELAYED_ERRORS` with the engine's message, else a ``RuntimeError``."""
    assert answer.error is not None
    relayed = RELAYED_ERRORS.get(answer.error_type or "")
    if relayed is not None:
        return relayed(answer.error.removeprefix(f"{answer.error_type}: "))
    return RuntimeError(f"engine utility failed: {answer.error}")
