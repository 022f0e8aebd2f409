"""The step watchdog of a tensor-parallel group (``--execute-model-timeout-s``).

A rank that hangs inside a step (stuck in a collective or a kernel, its process alive) would
leave every other rank waiting in the step's next collective for as long as the group's
timeout, and the operator would learn nothing. :class:`StepWatchdog` is a thread that the
driver arms when it sends a command to the ranks and disarms when every rank has answered;
when the time runs out first, it calls the executor's ``expire`` once, which gathers where
each unanswered rank is (:func:`driver_stack` for rank 0 in the driver's process, a
``faulthandler`` dump for a worker process: :func:`stack_path`, :func:`read_new_text`),
names the ranks (:func:`format_report`) and stops the workers, so that the driver's own part
of the step fails instead of waiting.

``faulthandler`` writes a worker's stacks from its signal handler in C, so it answers even
when the rank's Python thread is blocked inside a C++ collective or kernel.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

#: what a stack of a rank that waits for the others shows: the group's collectives
#: (``parallel_state``) or torch.distributed itself
_COLLECTIVE_MARKERS = (
    f"core{os.sep}parallel_state.py",
    f"torch{os.sep}distributed{os.sep}",
)
#: how long a worker's stack dump may take to appear, and how long it must stay unchanged to
#: count as complete
_DUMP_WAIT_S = 3.0
_DUMP_SETTLE_S = 0.1


def stack_path(ipc_dir: str, rank: int) -> str:
    """The file a worker process of ``rank`` appends its threads' stacks to on ``SIGUSR1``."""
    return os.path.join(ipc_dir, f"stacks-{rank}.txt")


def read_new_text(path: str, offset: int, wait_s: float = _DUMP_WAIT_S) -> str:
    """What was appended to ``path`` past ``offset``, once it stops growing (a dump being
    written); "" when nothing appears within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    size = -1
    while True:
        current = file_size(path)
        if current > offset and current == size:
            break
        if time.monotonic() >= deadline:
            break
        size = current
        time.sleep(_DUMP_SETTLE_S)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            file.seek(offset)
            return file.read()
    except OSError:
        return ""


def file_size(path: str) -> int:
    """``path``'s size in bytes, 0 when it does not exist."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def driver_stack(thread_id: int) -> str:
    """The Python stack of the thread ``thread_id`` of this process, most recent call last;
    a note when that thread is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "(the driver's thread is not running)\n"
    return "".join(traceback.format_stack(frame))


def waiting_in_collective(stack: str) -> bool:
    """Whether ``stack`` (a rank's main thread, any format) is inside a collective of the
    group, i.e. the rank waits for the others rather than holding them up."""
    return any(marker in stack for marker in _COLLECTIVE_MARKERS)


def stuck_ranks(pending: list[int], stacks: dict[int, str]) -> list[int]:
    """The ranks of ``pending`` whose stack is not in a collective: the likely culprits."""
    return [rank for rank in pending if not waiting_in_collective(stacks.get(rank, ""))]


class StepTimeoutError(RuntimeError):
    """A step of the group did not complete on every rank in time; the group is stopped.
    ``str(exc)`` is :func:`format_summary`'s line (which step, which ranks, the engine
    stopped), what callers and HTTP clients get; :attr:`report` adds each unanswered rank's
    Python stack (source paths: for the operator's log only, where the executor logs it at
    ERROR when the step times out)."""

    def __init__(self, summary: str, report: str) -> None:
        super().__init__(summary)
        self.report = report


def format_summary(
    method: str, timeout_s: float, pending: list[int], stacks: dict[int, str], size: int
) -> str:
    """One line: which of the ``size`` ranks have not answered ``method`` within
    ``timeout_s`` seconds and which of those are not waiting in a collective (the likely
    culprits); no stack."""
    stuck = stuck_ranks(pending, stacks)
    line = (
        f"tensor-parallel step {method!r} did not complete within {timeout_s:g} s "
        f"(--execute-model-timeout-s): rank(s) {pending} of {size} have not answered"
    )
    if stuck:
        line += f"; rank(s) {stuck} are not in a collective (the others wait for them)"
    return line + "; the tensor-parallel group is stopped (each rank's stack is in the log)"


def format_report(
    method: str, timeout_s: float, pending: list[int], stacks: dict[int, str], size: int
) -> str:
    """The operator's report of a step that did not complete: :func:`format_summary`'s line,
    then each unanswered rank's stack, marked busy or waiting in a collective."""
    stuck = stuck_ranks(pending, stacks)
    lines = [format_summary(method, timeout_s, pending, stacks, size)]
    for rank in pending:
        where = "waiting in a collective" if rank not in stuck else "busy"
        stack = stacks.get(rank) or "(no stack: the rank did not answer the dump signal)\n"
        lines.append(f"--- rank {rank} ({where}):\n{stack.rstrip()}")
    return "\n".join(lines)


@dataclass(frozen=True)
class StepTimeout:
    """What a step that ran out of time leaves: :func:`format_summary`'s line (for clients),
    :func:`format_report` (for the operator's log) and why the group is broken (the
    unanswered ranks not in a collective, or every unanswered rank)."""

    summary: str
    report: str
    broken: str

    @classmethod
    def of(
        cls, method: str, timeout_s: float, pending: list[int], stacks: dict[int, str], size: int
    ) -> StepTimeout:
        """The timeout of ``method`` after ``timeout_s`` seconds, ``pending`` of the ``size``
        ranks unanswered, with their ``stacks``."""
        args = (method, timeout_s, pending, stacks, size)
        culprits = stuck_ranks(pending, stacks) or pending
        return cls(
            format_summary(*args),
            format_report(*args),
            f"{method!r} timed out on rank(s) {culprits}",
        )

    def error(self) -> StepTimeoutError:
        """The error the driver raises for it (a new one each time it is raised)."""
        return StepTimeoutError(self.summary, self.report)


class StepWatchdog:
    """A thread that calls ``expire(what, thread_id)`` once when a step armed with
    :meth:`arm` is not :meth:`disarm`-ed within ``timeout_s`` seconds (``thread_id``: the
    thread that armed it, the driver's), in the watchdog's thread; :meth:`disarm` and
    :meth:`arm` wait while ``expire`` runs (it may read the step's state, which the armed
    thread then cannot move on to the next step's). ``expire`` is held weakly
    (a bound method of the executor, which must stay collectable). :meth:`close` ends the
    thread."""

    def __init__(self, timeout_s: float, expire: Callable[[str, int], None]) -> None:
        self.timeout_s = timeout_s
        self._expire = weakref.WeakMethod(expire)  # type: ignore[arg-type]
        self._cond = threading.Condition()
        self._armed: tuple[str, int, float] | None = None
        self._closed = False
        threading.Thread(target=self._run, daemon=True, name="chassis-tp-watchdog").start()

    def arm(self, what: str) -> None:
        """Start timing the step ``what`` (run by the calling thread)."""
        with self._cond:
            self._armed = (what, threading.get_ident(), time.monotonic() + self.timeout_s)
            self._cond.notify()

    def disarm(self) -> None:
        """The step completed on every rank (or failed): stop timing it."""
        with self._cond:
            # No wake-up: the thread finds nothing armed at the old deadline, or the next
            # arm() wakes it first; so a step costs one wake-up, not two.
            self._armed = None

    def close(self) -> None:
        """End the thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if self._armed is None:
                    self._cond.wait()
                    continue
                what, thread_id, deadline = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed = None
                expire = self._expire()
                if expire is None:  # the executor is gone
                    return
                # Under the lock: a driver that completes the step meanwhile waits in
                # disarm(), so the expiry sees this step's state, never the next step's.
                expire(what, thread_id)
                del expire  # (a reference left here would keep the executor alive)
