"""The front-end's handle on an engine-core child process.

Starts the process (``spawn``), binds two private ``ipc://`` sockets in a fresh 0700 temp
directory, waits for the ready message, then runs an output thread that decodes every
``EngineCoreOutputs`` and hands it to a callback, and a monitor thread that notices the
child's death. Sending is thread-safe. :meth:`EngineCoreClient.call_utility` asks the child to
run one of its utility methods (:mod:`chassis.core.engine_utility`) and returns a future.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from chassis.core.config import EngineConfig
from chassis.core.engine_core import EngineInfo
from chassis.core.engine_core_proc import (
    ABORT,
    ADD,
    ERROR,
    OUTPUTS,
    READY,
    SHUTDOWN,
    START_CONFIG_ERROR,
    UTILITY,
    UTILITY_RESULT,
    run_engine_core,
)
from chassis.core.engine_utility import UtilityCall, UtilityResult, utility_error
from chassis.core.errors import EngineDeadError
from chassis.core.request import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

#: how long start-up (model load, KV sizing) may take before we give up
STARTUP_TIMEOUT_S = float(os.environ.get("CHASSIS_ENGINE_STARTUP_TIMEOUT", "900"))


class EngineCoreClient:
    """Runs the engine core in a child process and talks to it."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        while_starting: Callable[[], None] | None = None,
    ) -> None:
        """Start the engine core and return once it is ready (its :class:`EngineInfo` in
        ``info``); ``on_outputs`` and ``on_dead`` are called from the client's threads.

        ``while_starting``, when given, runs in this process after the child is started and
        before waiting for it (the front-end loads its tokenizer meanwhile, on another core
        than the child's imports and model load). If it raises, the child is killed and the
        exception propagates, as for a child that fails to start.
        """
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._closing = False
        self._dead_reported = False
        self._send_lock = threading.Lock()
        self._dead_lock = threading.Lock()
        self._output_thread: threading.Thread | None = None
        #: utility calls sent and not answered yet, by call id (under _pending_lock)
        self._pending: dict[int, Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._ipc_dir = tempfile.mkdtemp(prefix="chassis-ipc-")
        os.chmod(self._ipc_dir, 0o700)
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"

        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(input_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(output_addr)

        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(
            target=run_engine_core,
            args=(config.to_dict(), input_addr, output_addr, logging.getLogger().level),
            name="chassis-engine-core",
            daemon=True,
        )
        self.process.start()
        try:
            if while_starting is not None:
                while_starting()
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            self._cleanup()
            raise
        self._output_thread = threading.Thread(
            target=self._read_outputs, daemon=True, name="chassis-output"
        )
        self._output_thread.start()
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="chassis-monitor")
        self._monitor.start()

    # -- start-up -------------------------------------------------------------------------

    def _wait_ready(self) -> EngineInfo:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            if poller.poll(500):
                kind, payload, *detail = self._out.recv_multipart()
                if kind == READY:
                    return msgspec.msgpack.decode(payload, type=EngineInfo)
                if kind == ERROR and detail == [START_CONFIG_ERROR]:
                    raise ValueError(payload.decode())  # a settings error, like the front-end's
                if kind == ERROR:
                    raise EngineDeadError(f"engine core failed to start: {payload.decode()}")
                raise EngineDeadError(f"unexpected first message from engine core: {kind!r}")
            waited += 0.5
            if not self.process.is_alive():
                raise EngineDeadError(
                    f"engine core exited during start-up (exit code {self.process.exitcode}); "
                    "see its log above"
                )
        raise EngineDeadError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    # -- running --------------------------------------------------------------------------

    def _read_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        utility_decoder = msgspec.msgpack.Decoder(UtilityResult)
        while True:
            try:
                kind, payload = self._out.recv_multipart()
            except zmq.ZMQError:  # ETERM: the context is being terminated at shutdown
                self._out.close(0)
                self._fail_pending("the engine core is shutting down")
                return
            if kind == UTILITY_RESULT:
                self._resolve(utility_decoder.decode(payload))
                continue
            if kind != OUTPUTS:
                continue
            outputs = decoder.decode(payload)
            if outputs.engine_error:
                # Close before leaving: shutdown's context term() waits for every socket, and
                # only this thread may close this one.
                self._out.close(0)
                self._report_dead(f"engine core failed: {outputs.engine_error}")
                return
            try:
                self._on_outputs(outputs)
            except Exception:
                logger.exception("error while processing engine outputs")

    def _watch(self) -> None:
        self.process.join()
        if not self._closing:
            self._report_dead(f"engine core process died (exit code {self.process.exitcode})")

    def _report_dead(self, reason: str) -> None:
        with self._dead_lock:
            if self._dead_reported:
                return
            self._dead_reported = True
        logger.error("%s", reason)
        self._fail_pending(reason)
        self._on_dead(reason)

    @property
    def is_alive(self) -> bool:
        return not self._dead_reported and self.process.is_alive()

    def _send(self, kind: bytes, payload: bytes) -> None:
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        with self._send_lock:
            self._in.send_multipart([kind, payload])

    @property
    def infos(self) -> list[EngineInfo]:
        """Every engine's start-up report: this one's (``DataParallelClient`` has several)."""
        return [self.info]

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, msgspec.msgpack.encode(request))

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Send the engine requests of one prompt (``n`` > 1: one per completion)."""
        for request in requests:
            self.add_request(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and self.is_alive:
            self._send(ABORT, msgspec.msgpack.encode(ids))

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """Ask the engine core to run ``method(*args)`` between steps. The future gets the
        return value; ``RuntimeError`` with the engine's message when the method raised or is
        not a utility (one of ``engine_utility.RELAYED_ERRORS`` as itself); :class:`EngineDeadError` when the engine core died or shut down
        first (raised here at once when it is not running)."""
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        with self._pending_lock:
            self._pending[call_id] = future
        try:
            self._send(
                UTILITY,
                msgspec.msgpack.encode(
                    UtilityCall(call_id=call_id, method=method, args=list(args))
                ),
            )
        except BaseException:
            with self._pending_lock:
                self._pending.pop(call_id, None)
            raise
        # A death after the send is failed by whoever sees it: the monitor thread
        # (_report_dead) or, during shutdown, the output thread (_fail_pending).
        return future

    def _resolve(self, answer: UtilityResult) -> None:
        with self._pending_lock:
            future = self._pending.pop(answer.call_id, None)
        if future is None:
            return
        if answer.error is not None:
            future.set_exception(utility_error(answer))
        else:
            future.set_result(answer.result)

    def _fail_pending(self, reason: str) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(EngineDeadError(reason))

    # -- shutdown -------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine core to exit, then make sure it has (terminate, kill)."""
        if self._closing:
            return
        self._closing = True
        if self.process.is_alive():
            try:
                with self._send_lock:
                    self._in.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        self._kill()
        self._cleanup()

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _cleanup(self) -> None:
        self._in.close(0)
        if getattr(self, "_output_thread", None) is None:
            self._out.close(0)
        # term() makes the output thread's blocking recv fail with ETERM; it then closes its
        # socket (sockets are not thread-safe, so only their own thread closes them).
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
