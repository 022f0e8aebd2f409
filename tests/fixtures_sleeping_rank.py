"""Source a test writes as ``sitecustomize.py`` (put on ``PYTHONPATH``) so that the
processes of a tensor-parallel engine run it first: a rank that hangs inside a step."""

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
