"""A tensor-parallel worker process (ranks 1..N-1): ``python -m chassis.core.tp_worker_proc
IPC_DIR RANK DRIVER_PID LOG_LEVEL``, started by
:class:`~chassis.core.tp_executor.TensorParallelExecutor`.

It connects to the driver's sockets in ``IPC_DIR`` and waits for ``init`` (the engine config).
It answers ``joining``, joins the tensor-parallel group, loads its share of the model and
answers again; then it runs every command the driver sends (``num_blocks``, ``init_cache``,
``execute``, ``pin_lora``, ``unpin_lora``, ``sleep``, ``wake_up``:
:func:`chassis.core.tp_executor.run_command`, as
every carrier of the step protocol does; and ``shutdown``) in order, replying to each with
``[rank, ok, result-or-error]``.
Frames are msgspec msgpack.

On ``SIGUSR1`` it appends every thread's Python stack to ``stacks-RANK.txt`` in ``IPC_DIR``
(``faulthandler``, written from the signal handler, so even while a collective or kernel
blocks the rank): the driver's step watchdog asks for it (``chassis.core.tp_watchdog``).

It exits on ``shutdown``; after reporting any failure (so that the driver's collectives with
it fail at once instead of waiting for it); and when the driver process is gone (its parent
pid changes: checked every second while idle, and before it starts).
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # A rank process: no cyclic garbage collection while it imports torch and transformers
    # and loads its share of the model (the collector walked the imports' objects again and
    # again: ~0.45 s of the ~3.4 s of CPU until the model is loaded, on the 2-core dev VM);
    # switched on again once the model is loaded (_start).
    gc.disable()

import contextlib
import faulthandler
import functools
import logging
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import msgspec
import zmq

from chassis.core.lora.request import LoRARequest
from chassis.core.scheduler_interface import SchedulerOutput
from chassis.core.tp_watchdog import stack_path

logger = logging.getLogger("chassis.tp_worker")

INIT, NUM_BLOCKS, INIT_CACHE, EXECUTE, SHUTDOWN, PIN_LORA, UNPIN_LORA = (
    "init",
    "num_blocks",
    "init_cache",
    "execute",
    "shutdown",
    "pin_lora",
    "unpin_lora",
)
#: sleep mode: ``sleep`` (payload: the level) and ``wake_up`` (payload: the tags)
SLEEP, WAKE_UP = "sleep", "wake_up"
#: the first reply to ``init``: the rank is alive and joins the group now
JOINING = "joining"
_IDLE_CHECK_MS = 1000

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_plan_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def try_pin_lora(worker: Any, lora_request: LoRARequest) -> str | None:
    """Pin the adapter in ``worker``'s host memory; the reason it cannot be read, or None
    (an adapter a rank cannot read fails the request that names it, not the rank)."""
    if worker.lora is None:
        return None
    try:
        worker.lora.pin(lora_request)
    except ValueError as exc:
        return str(exc)
    return None


def failure_detail(rank: int, method: str, exc: BaseException) -> str:
    """Log rank ``rank``'s failure of command ``method`` with its traceback; return the
    one-line ``Type: message`` the rank reports (the driver raises it, ``ValueError`` for a
    ``ValueError``: ``chassis.core.tp_executor._rank_error``)."""
    logger.error("tensor-parallel rank %d: %s failed", rank, method, exc_info=exc)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _decode_payload(method: str, payload: msgspec.Raw) -> Any:
    """A command's msgpack payload as ``tp_executor.run_command`` takes it (typed where
    plain msgpack would lose the type)."""
    if method == EXECUTE:
        return _plan_decoder.decode(payload)
    if method == PIN_LORA:
        return msgspec.msgpack.decode(payload, type=LoRARequest)
    return msgspec.msgpack.decode(payload)


def command_address(ipc_dir: str, rank: int) -> str:
    """Where the driver sends rank ``rank`` its commands."""
    return f"ipc://{ipc_dir}/command-{rank}"


def reply_address(ipc_dir: str) -> str:
    """Where every worker sends its replies."""
    return f"ipc://{ipc_dir}/reply"


def rendezvous(ipc_dir: str) -> str:
    """The ``torch.distributed`` rendezvous of the group."""
    return f"file://{ipc_dir}/rendezvous"


def main(ipc_dir: str, rank: int, driver_pid: int) -> int:
    from chassis.core.engine_core_proc import set_process_name

    set_process_name(f"chassis-tp{rank}")
    # Ctrl-C in a terminal reaches the whole process group: the driver stops this rank in
    # order (SHUTDOWN); dying mid-collective would fail the driver's step instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != driver_pid:
        return _orphaned(ipc_dir, rank)
    # Each resource is released (in reverse order) from the moment it is taken, whatever
    # fails afterwards: a socket that cannot connect leaves no stacks file open and no
    # signal handler writing to a closed one.
    with contextlib.ExitStack() as release:
        # (append mode: the driver reads each dump from the size it saw before signalling)
        stacks = release.enter_context(open(stack_path(ipc_dir, rank), "a", encoding="utf-8"))
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        release.callback(faulthandler.unregister, signal.SIGUSR1)
        ctx = zmq.Context()
        release.callback(ctx.term)
        commands = ctx.socket(zmq.PULL)
        release.callback(commands.close, 0)
        commands.connect(command_address(ipc_dir, rank))
        replies = ctx.socket(zmq.PUSH)
        release.callback(replies.close)
        replies.setsockopt(zmq.LINGER, 1000)
        replies.connect(reply_address(ipc_dir))
        release.callback(_leave_group)
        return _serve(ipc_dir, rank, driver_pid, commands, replies)


def _leave_group() -> None:
    """Leave the tensor-parallel group (if this rank joined it)."""
    from chassis.core import parallel_state

    parallel_state.destroy_tensor_parallel()


def _serve(
    ipc_dir: str, rank: int, driver_pid: int, commands: zmq.Socket, replies: zmq.Socket
) -> int:
    """Run the driver's commands until ``shutdown``, a failure or the driver's end; the
    process's exit code."""
    # (not at module level: tp_executor imports this module; once here, not every step)
    from chassis.core.tp_executor import run_command

    worker: Any = None
    while True:
        if not commands.poll(_IDLE_CHECK_MS):
            if os.getppid() != driver_pid:
                return _orphaned(ipc_dir, rank)
            continue
        method, payload = _command_decoder.decode(commands.recv())
        try:
            if method == SHUTDOWN:
                replies.send(_encoder.encode([rank, True, None]))
                return 0
            if method == INIT:
                replies.send(_encoder.encode([rank, True, JOINING]))
                watch = functools.partial(_watch_while_joining, commands, driver_pid)
                try:
                    worker = _start(msgspec.msgpack.decode(payload), ipc_dir, rank, watch)
                except _DriverGone:
                    return _orphaned(ipc_dir, rank)
                except _ShutdownWhileJoining:
                    replies.send(_encoder.encode([rank, True, None]))
                    return 0
                result: Any = None
            else:
                result = run_command(worker, method, _decode_payload(method, payload), rank)
        except Exception as exc:
            detail = failure_detail(rank, method, exc)
            replies.send(_encoder.encode([rank, False, detail]))
            return 1  # leaving fails the driver's collectives with this rank at once
        replies.send(_encoder.encode([rank, True, result]))


def _orphaned(ipc_dir: str, rank: int) -> int:
    """The driver died without stopping this rank: clean up its directory and exit."""
    logger.warning("tensor-parallel rank %d: the driver process is gone; exiting", rank)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    return 1


class _ShutdownWhileJoining(Exception):
    """The driver sent ``shutdown`` while this rank waited for the group to form (the driver
    failed before joining): leave quietly."""


class _DriverGone(Exception):
    """The driver process died while this rank waited for the group to form."""


def _watch_while_joining(commands: zmq.Socket[bytes], driver_pid: int) -> None:
    """What this rank checks while it waits for the others to join (the driver sends nothing
    but ``shutdown`` then): raise :class:`_ShutdownWhileJoining` or :class:`_DriverGone`."""
    if os.getppid() != driver_pid:
        raise _DriverGone
    if commands.poll(0):
        method, _ = _command_decoder.decode(commands.recv())
        if method == SHUTDOWN:
            raise _ShutdownWhileJoining
        raise RuntimeError(f"{method!r} arrived before the group formed")


def _start(config_dict: dict[str, Any], ipc_dir: str, rank: int, watch: Callable[[], None]) -> Any:
    """Join the group (``watch``-ing the driver while waiting for it) and load this rank's
    share of the model."""
    from chassis.core.config import EngineConfig
    from chassis.core.tp_executor import start_rank

    config = EngineConfig.from_dict(config_dict)
    worker = start_rank(config, rank, ipc_dir, watch)
    gc.enable()  # (off while a rank process started: the top of this module)
    return worker


def exit_without_finalization(code: int) -> NoReturn:
    """End this process with ``code`` once :func:`main` has returned, skipping the
    interpreter's finalization: every resource of the rank is released by then (``main``'s
    ``ExitStack``: the group, the sockets, the stacks file), and tearing down the modules of
    torch and transformers took ~0.9 s of CPU that the driver waited for at every engine
    shutdown (``_Ranks.stop``). Log records and output are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(
        level=int(sys.argv[4]),
        format="%(asctime)s %(levelname)s [tp" + sys.argv[2] + "] %(name)s: %(message)s",
    )
    # (an exception out of main still ends the process the usual way, with its traceback)
    exit_without_finalization(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
