"""Code that the processes a test starts run first: written as their ``sitecustomize.py``
in a folder put on ``PYTHONPATH`` (:func:`run_at_process_start`), and the source of a rank
that hangs inside a step (:data:`SLEEPING_RANK`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def run_at_process_start(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Have the Python processes started after this (the ranks' worker processes, a
    server's processes; not this one) run ``source`` first, as their ``sitecustomize``."""
    (tmp_path / "sitecustomize.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


#: rank 1 (only: the sitecustomize is also read by a server's own processes) sleeps inside
#: its second step, process alive, while rank 0 waits for it in the step's first collective
SLEEPING_RANK = """\
import time

import chassis.core.worker as worker_module
from chassis.core import parallel_state

_execute = worker_module.Worker.execute_model
calls = []


def sleep_inside_a_step():
    time.sleep(600)


def execute_model(self, scheduler_output):
    calls.append(1)
    if len(calls) == 2 and parallel_state.tp_rank() == 1:
        sleep_inside_a_step()
    return _execute(self, scheduler_output)


worker_module.Worker.execute_model = execute_model
"""
