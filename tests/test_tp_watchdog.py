"""The tensor-parallel step watchdog's parts (``core/tp_watchdog.py``) without a group: the
report, the reading of a worker's stack dump, and the timer thread. The whole path (ranks
hanging in a step) is tested in tests/test_tensor_parallel.py."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from chassis.core.tp_watchdog import (
    StepTimeout,
    StepTimeoutError,
    StepWatchdog,
    driver_stack,
    format_report,
    format_summary,
    read_new_text,
    stuck_ranks,
    waiting_in_collective,
)

IN_COLLECTIVE = (
    '  File "/x/chassis/core/parallel_state.py", line 86 in all_reduce\n'
    '  File "/x/chassis/core/layers/linear.py", line 10 in forward\n'
)
BUSY = '  File "/x/chassis/core/worker.py", line 5 in execute_model\n'


def test_the_report_names_the_ranks_that_are_not_in_a_collective() -> None:
    stacks = {0: IN_COLLECTIVE, 1: BUSY, 2: IN_COLLECTIVE}
    assert waiting_in_collective(IN_COLLECTIVE) and not waiting_in_collective(BUSY)
    assert stuck_ranks([0, 1, 2], stacks) == [1]
    report = format_report("execute", 2.5, [0, 1, 2], stacks, 4)
    first, *rest = report.splitlines()
    assert first == (
        "tensor-parallel step 'execute' did not complete within 2.5 s "
        "(--execute-model-timeout-s): rank(s) [0, 1, 2] of 4 have not answered; rank(s) [1] "
        "are not in a collective (the others wait for them); the tensor-parallel group is "
        "stopped (each rank's stack is in the log)"
    )
    assert first == format_summary("execute", 2.5, [0, 1, 2], stacks, 4)
    assert "--- rank 1 (busy):" in rest and "--- rank 2 (waiting in a collective):" in rest
    assert "line 5 in execute_model" in report.split("--- rank 1 (busy):")[1]


def test_a_step_timeout_s_message_is_the_summary_and_its_report_has_the_stacks() -> None:
    stacks = {1: BUSY}
    timeout = StepTimeout.of("execute", 1, [1], stacks, 2)
    assert timeout.summary == format_summary("execute", 1, [1], stacks, 2)
    assert timeout.report == format_report("execute", 1, [1], stacks, 2)
    error = timeout.error()
    assert isinstance(error, StepTimeoutError) and error is not timeout.error()
    assert "rank(s) [1] of 2 have not answered" in str(error)
    assert "worker.py" not in str(error) and "--- rank" not in str(error)
    assert "line 5 in execute_model" in error.report


def test_the_broken_reason_names_the_busy_ranks_else_every_unanswered_one() -> None:
    busy = StepTimeout.of("execute", 1, [0, 1], {0: IN_COLLECTIVE, 1: BUSY}, 2)
    assert busy.broken == "'execute' timed out on rank(s) [1]"
    waiting = StepTimeout.of("execute", 1, [0, 1], {0: IN_COLLECTIVE, 1: IN_COLLECTIVE}, 2)
    assert waiting.broken == "'execute' timed out on rank(s) [0, 1]"


def test_a_rank_without_a_dump_is_still_named() -> None:
    report = format_report("execute", 1, [1], {1: ""}, 2)
    assert "rank(s) [1] are not in a collective" in report
    assert "(no stack: the rank did not answer the dump signal)" in report


def test_a_dump_is_read_from_where_the_file_ended(tmp_path) -> None:
    path = tmp_path / "stacks-1.txt"
    path.write_text("an older dump\n")
    offset = path.stat().st_size
    with open(path, "a") as file:
        file.write(BUSY)
    assert read_new_text(str(path), offset) == BUSY
    assert read_new_text(str(tmp_path / "missing.txt"), 0, wait_s=0.2) == ""


def test_the_driver_stack_is_the_given_thread_s() -> None:
    assert "in test_the_driver_stack_is_the_given_thread_s" in driver_stack(threading.get_ident())
    assert "not running" in driver_stack(-1)


class _Expiries:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.done = threading.Event()

    def expire(self, what: str, thread_id: int) -> None:
        self.seen.append((what, thread_id))
        self.done.set()


@pytest.mark.timeout(30)
def test_an_armed_step_that_is_not_disarmed_expires_once() -> None:
    expiries = _Expiries()
    watchdog = StepWatchdog(0.05, expiries.expire)
    watchdog.arm("execute")
    assert expiries.done.wait(20)
    watchdog.close()
    assert expiries.seen == [("execute", threading.get_ident())]


@pytest.mark.timeout(30)
def test_a_step_costs_one_wake_up_and_a_disarmed_step_never_expires() -> None:
    """arm() wakes the thread, disarm() does not: past a disarmed step's deadline the
    thread finds nothing armed and goes on waiting for the next step."""
    expiries = _Expiries()
    watchdog = StepWatchdog(0.01, expiries.expire)
    wake_ups: list[int] = []
    notify = watchdog._cond.notify
    watchdog._cond.notify = lambda n=1: (wake_ups.append(n), notify(n))  # type: ignore[method-assign]
    for _ in range(3):
        watchdog.arm("execute")
        watchdog.disarm()
    time.sleep(0.05)  # (lets the disarmed steps' deadlines pass; nothing is timed)
    watchdog.arm("sample")
    assert expiries.done.wait(20)
    assert len(wake_ups) == 4
    watchdog.close()
    assert expiries.seen == [("sample", threading.get_ident())]


class _DriverDisarmingDuringTheExpiry:
    """An expiry during which the driver's thread completes the step (disarms)."""

    def __init__(self) -> None:
        self.watchdog: StepWatchdog | None = None
        self.disarmed = threading.Event()
        self.disarmed_during_expiry: list[bool] = []

    def expire(self, what: str, thread_id: int) -> None:
        driver = threading.Thread(target=self._complete_the_step)
        driver.start()
        driver.join(0.5)  # long enough for a disarm that does not wait to return
        self.disarmed_during_expiry.append(self.disarmed.is_set())

    def _complete_the_step(self) -> None:
        assert self.watchdog is not None
        self.watchdog.disarm()
        self.disarmed.set()


@pytest.mark.timeout(30)
def test_a_step_completing_while_it_expires_is_disarmed_after_the_expiry() -> None:
    # Else the driver could move on to the next step, whose state the expiry would read
    # (no rank has answered it yet) as the expired step's.
    driver = _DriverDisarmingDuringTheExpiry()
    watchdog = StepWatchdog(0.01, driver.expire)
    driver.watchdog = watchdog
    watchdog.arm("execute")
    assert driver.disarmed.wait(20)
    watchdog.close()
    assert driver.disarmed_during_expiry == [False]


@pytest.mark.timeout(30)
def test_the_watchdog_does_not_keep_its_executor_alive_after_an_expiry() -> None:
    # (the executor's finalizer stops the ranks when an LLM is dropped without shutdown)
    expiries = _Expiries()
    done = expiries.done
    watchdog = StepWatchdog(0.01, expiries.expire)
    watchdog.arm("execute")
    assert done.wait(20)
    alive = weakref.ref(expiries)
    del expiries
    with watchdog._cond:  # the expiry has returned once the watchdog waits again
        gc.collect()
    watchdog.close()
    assert alive() is None
