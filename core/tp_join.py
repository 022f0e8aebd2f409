"""The watched start-up barrier of a tensor-parallel group whose ranks share a host.

``torch.distributed.init_process_group`` waits for every rank inside C++ (gloo's rendezvous),
for as long as the group's timeout (30 minutes), and nothing can interrupt it: not a rank
that died before joining, not a Python signal handler (pytest-timeout's ``signal`` method).
So each rank first meets the others here, in Python, where it can look around while it
waits: :func:`wait_for_every_rank` marks the rank's arrival with a file in the group's
directory and polls for the others' files, calling a ``watch`` that raises when waiting is
pointless (the driver: a rank process exited; a worker: the driver asked it to stop or is
gone). Only when every rank has arrived does any of them enter ``init_process_group``, which
then returns at once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: how long a rank waits for the others to arrive before giving up (none does anything slow
#: before arriving: they start, import, and arrive)
JOIN_TIMEOUT_S = 300.0
_POLL_S = 0.05


def arrival_path(ipc_dir: str, rank: int) -> str:
    """The file whose existence says that ``rank`` has arrived."""
    return os.path.join(ipc_dir, f"arrived-{rank}")


def wait_for_every_rank(
    ipc_dir: str,
    rank: int,
    size: int,
    watch: Callable[[], None],
    timeout_s: float = JOIN_TIMEOUT_S,
) -> None:
    """Mark ``rank`` as arrived in ``ipc_dir`` and return once all ``size`` ranks have.

    ``watch`` is called about every 50 ms while waiting; whatever it raises ends the wait
    (propagated as is). ``TimeoutError`` naming the missing ranks after ``timeout_s``.
    """
    with open(arrival_path(ipc_dir, rank), "wb"):
        pass
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(size) if not os.path.exists(arrival_path(ipc_dir, r))]
        if not missing:
            return
        watch()
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"tensor-parallel rank {rank}: rank(s) {missing} did not arrive to form the "
                f"group within {timeout_s:g} s"
            )
        time.sleep(_POLL_S)
