"""A tensor-parallel worker process's own resources (core/tp_worker_proc.py), in-process and
without a group; the worker processes themselves are tested in tests/test_tensor_parallel.py."""

from __future__ import annotations

import faulthandler
import os
import signal

import psutil
import pytest
import zmq

from chassis.core import engine_core_proc, tp_worker_proc
from chassis.core.tp_watchdog import stack_path


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="the stack dump signal is POSIX's")
def test_a_worker_that_cannot_connect_leaves_no_stacks_file_open(tmp_path, monkeypatch) -> None:
    """Whatever fails once the stacks file is open, it is closed and its dump handler gone."""
    monkeypatch.setattr(engine_core_proc, "set_process_name", lambda name: None)
    monkeypatch.setattr(tp_worker_proc, "reply_address", lambda ipc_dir: "no-such-transport://x")
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(zmq.ZMQError):
            tp_worker_proc.main(str(tmp_path), 1, os.getppid())
    finally:
        signal.signal(signal.SIGINT, previous)
    path = stack_path(str(tmp_path), 1)
    assert os.path.exists(path)  # it was opened
    assert path not in [file.path for file in psutil.Process().open_files()]
    assert not faulthandler.unregister(signal.SIGUSR1)  # nothing left registered
