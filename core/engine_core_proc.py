"""The engine core as a child process, fed over ZMQ with msgpack (no pickle on the socket).

Wire protocol (multipart frames): front-end -> engine ``[b"add", EngineCoreRequest]``,
``[b"abort", list[str]]``, ``[b"utility", UtilityCall]``, ``[b"shutdown", b""]``; engine ->
front-end ``[b"ready", EngineInfo]`` once, ``[b"error", str]`` if start-up fails, then
``[b"outputs", EngineCoreOutputs]`` per step and ``[b"utility_result", UtilityResult]`` per
utility call (between steps, in the order the calls came). An input thread and an output
thread move frames between the sockets and queues, so the busy loop never blocks on I/O.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
from typing import Any

import msgspec
import zmq

from chassis.core.engine_utility import UtilityCall, run_utility
from chassis.core.heap import freeze_startup_heap
from chassis.core.request import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

ADD, ABORT, UTILITY, SHUTDOWN = b"add", b"abort", b"utility", b"shutdown"
READY, ERROR, OUTPUTS, UTILITY_RESULT = b"ready", b"error", b"outputs", b"utility_result"
#: third frame of an ERROR at start-up: the settings cannot work (a ValueError)
START_CONFIG_ERROR = b"config"

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_abort_decoder = msgspec.msgpack.Decoder(list[str])
_utility_decoder = msgspec.msgpack.Decoder(UtilityCall)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans), and name it
    ``chassis-engine``."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent-pid check in the loop covers it
    set_process_name("chassis-engine")


def set_process_name(name: str) -> None:
    """Name this process ``name`` in ``ps``/``pgrep chassis`` (its command line is
    Python's); Linux only, 15 bytes at most."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def run_engine_core(
    config_dict: dict[str, Any], input_addr: str, output_addr: str, log_level: int
) -> None:
    """Entry point of the engine-core child process."""
    parent_pid = os.getppid()
    _die_with_parent()
    # (with data parallelism each engine's lines name it: "[engine 1]")
    engine = "engine"
    if config_dict.get("data_parallel_size", 1) > 1:
        engine = f"engine {config_dict.get('data_parallel_rank', 0)}"
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [{engine}] %(name)s: %(message)s"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C in a terminal reaches the whole process group; the front-end owns it and shuts
    # this process down in order (a KeyboardInterrupt here would be a crash mid-step).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 1000)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)

    try:
        from chassis.core.config import EngineConfig
        from chassis.core.data_parallel import take_host_share
        from chassis.core.engine_core import EngineCore

        config = EngineConfig.from_dict(config_dict)
        take_host_share(config)  # one engine of several: its share of the cores
        core = EngineCore(config)
    except BaseException as exc:
        _die_quietly_on_sigterm()
        if isinstance(exc, SystemExit):  # SIGTERM while loading: the front-end is stopping
            logger.info("engine core stopped during start-up")
            kind, text = b"", "stopped during start-up"
        elif isinstance(exc, ValueError):  # the settings cannot work (the message says why)
            logger.error("engine core cannot start: %s", exc)
            logger.debug("where it was raised", exc_info=True)  # --log-level DEBUG
            kind, text = START_CONFIG_ERROR, str(exc)
        else:
            logger.exception("engine core failed to start")
            kind, text = b"", f"{type(exc).__name__}: {exc}"
        out_sock.send_multipart([ERROR, text.encode(), kind])
        out_sock.close()
        raise SystemExit(1) from exc
    freeze_startup_heap()  # this process serves one engine until it exits
    out_sock.send_multipart([READY, _encoder.encode(core.info)])

    inputs: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
    #: (frame kind, payload) to send; None ends the writer
    outputs: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()

    def read_inputs() -> None:
        while True:
            try:
                kind, payload = in_sock.recv_multipart()
            except zmq.ZMQError:
                return
            inputs.put((kind, payload))

    def write_outputs() -> None:
        while True:
            item = outputs.get()
            if item is None:
                return
            out_sock.send_multipart(list(item))

    threading.Thread(target=read_inputs, daemon=True, name="engine-input").start()
    writer = threading.Thread(target=write_outputs, daemon=True, name="engine-output")
    writer.start()

    try:
        _busy_loop(core, inputs, outputs, parent_pid)
    except BaseException as exc:
        _die_quietly_on_sigterm()
        if not isinstance(exc, SystemExit):
            # The whole error and its traceback go to this process's log (the server's);
            # the front-end passes engine_error on to every client of the dead engine.
            logger.exception("engine core crashed")
            error = crash_message_for_clients(exc)
            outputs.put((OUTPUTS, _encoder.encode(EngineCoreOutputs(engine_error=error))))
        outputs.put(None)
        writer.join(timeout=5)
        # This process ends with os._exit (multiprocessing), which runs no atexit handler:
        # stop the workers here.
        with contextlib.suppress(Exception):
            core.shutdown()
        raise
    _die_quietly_on_sigterm()
    outputs.put(None)
    writer.join(timeout=5)
    core.shutdown()


def crash_message_for_clients(exc: BaseException) -> str:
    """What HTTP clients are told of the crash ``exc`` of the busy loop: one short line
    with nothing of the engine's internals. An error may carry anything in its message
    (paths, tensor shapes, a worker's traceback text), so clients get its type only and the
    pointer to the server log, where :func:`run_engine_core` logs it whole. The exceptions
    are the errors whose message is written for clients, also as the cause of another
    error: the tensor-parallel watchdog's :class:`~chassis.core.tp_watchdog.StepTimeoutError`
    (which step, which ranks have not answered; the stacks are in the log only) and
    :class:`~chassis.core.errors.RankExitedError` (which rank exited, its exit code)."""
    from chassis.core.errors import RankExitedError
    from chassis.core.tp_watchdog import StepTimeoutError

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, StepTimeoutError | RankExitedError):
            return str(cause)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return (
        f"{type(exc).__name__} in the engine core; its message and traceback are in the server log"
    )


def _die_quietly_on_sigterm() -> None:
    """On the way out, a SIGTERM (the front-end making sure this process ends) ends it at
    once: raised as SystemExit it would land in whatever exit handler runs, as a second
    traceback in the log that has nothing to do with the error."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _busy_loop(
    core: Any,
    inputs: queue.Queue[tuple[bytes, bytes]],
    outputs: queue.Queue[tuple[bytes, bytes] | None],
    parent_pid: int,
) -> None:
    aborted_since_step = False
    while True:
        # Block for input only when idle; otherwise take what arrived and step.
        block = not core.has_unfinished() and not aborted_since_step
        while True:
            try:
                kind, payload = inputs.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                if block and os.getppid() != parent_pid:
                    logger.warning("front-end process is gone; engine core exits")
                    return
                if block:
                    core.check_health()  # idle: a dead worker is reported now, not later
                break
            block = False
            if kind == ADD:
                core.add_request(_request_decoder.decode(payload))
            elif kind == ABORT:
                core.abort_requests(_abort_decoder.decode(payload))
                aborted_since_step = True
            elif kind == UTILITY:
                result = run_utility(core, _utility_decoder.decode(payload))
                outputs.put((UTILITY_RESULT, _encoder.encode(result)))
            elif kind == SHUTDOWN:
                return
        if core.has_unfinished() or aborted_since_step:
            result = core.step()
            aborted_since_step = False
            outputs.put((OUTPUTS, _encoder.encode(result)))
