"""A tensor-parallel worker process (ranks 1..N-1): ``python -m chassis.core.tp_worker_proc
IPC_DIR RANK``, started by :class:`~chassis.core.tp_executor.TensorParallelExecutor`.

It connects to the driver's sockets in ``IPC_DIR``, waits for ``init`` (the engine config),
joins the tensor-parallel group, loads its share of the model, and then runs every command
the driver sends (``num_blocks``, ``init_cache``, ``execute``, ``shutdown``) in order,
replying to each with ``[rank, ok, result-or-error]``. Frames are msgspec msgpack. It exits
on ``shutdown``, and with its parent (Linux ``PR_SET_PDEATHSIG``, or the sockets closing).
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from typing import Any

import msgspec
import zmq

from chassis.core.scheduler_interface import SchedulerOutput

logger = logging.getLogger("chassis.tp_worker")

INIT, NUM_BLOCKS, INIT_CACHE, EXECUTE, SHUTDOWN = (
    "init",
    "num_blocks",
    "init_cache",
    "execute",
    "shutdown",
)

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_plan_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def command_address(ipc_dir: str, rank: int) -> str:
    """Where the driver sends rank ``rank`` its commands."""
    return f"ipc://{ipc_dir}/command-{rank}"


def reply_address(ipc_dir: str) -> str:
    """Where every worker sends its replies."""
    return f"ipc://{ipc_dir}/reply"


def rendezvous(ipc_dir: str) -> str:
    """The ``torch.distributed`` rendezvous of the group."""
    return f"file://{ipc_dir}/rendezvous"


def main(ipc_dir: str, rank: int) -> int:
    from chassis.core.engine_core_proc import die_with_parent

    die_with_parent(f"chassis-tp{rank}")
    # Ctrl-C in a terminal reaches the whole process group: the driver stops this rank in
    # order (SHUTDOWN); dying mid-collective would fail the driver's step instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_address(ipc_dir, rank))
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 1000)
    replies.connect(reply_address(ipc_dir))
    worker: Any = None
    try:
        while True:
            method, payload = _command_decoder.decode(commands.recv())
            try:
                if method == SHUTDOWN:
                    replies.send(_encoder.encode([rank, True, None]))
                    return 0
                if method == INIT:
                    worker = _start(msgspec.msgpack.decode(payload), ipc_dir, rank)
                    result: Any = None
                elif method == NUM_BLOCKS:
                    result = worker.determine_num_blocks()
                elif method == INIT_CACHE:
                    worker.initialize_cache(msgspec.msgpack.decode(payload))
                    result = None
                elif method == EXECUTE:
                    result = worker.execute_model(_plan_decoder.decode(payload)).sampled_token_ids
                else:
                    raise ValueError(f"unknown command {method!r}")
            except Exception as exc:
                logger.error("tensor-parallel rank %d: %s failed", rank, method, exc_info=True)
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                replies.send(_encoder.encode([rank, False, detail]))
                if method == INIT:
                    return 1
                continue
            replies.send(_encoder.encode([rank, True, result]))
    finally:
        from chassis.core import parallel_state

        parallel_state.destroy_tensor_parallel()
        commands.close(0)
        replies.close()
        ctx.term()


def _start(config_dict: dict[str, Any], ipc_dir: str, rank: int) -> Any:
    """Join the group and load this rank's share of the model."""
    from chassis.core.config import EngineConfig
    from chassis.core.tp_executor import start_rank

    config = EngineConfig.from_dict(config_dict)
    return start_rank(config, rank, rendezvous(ipc_dir))


if __name__ == "__main__":
    logging.basicConfig(level=int(sys.argv[3]) if len(sys.argv) > 3 else logging.INFO)
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
