"""Data parallelism's placement: which devices and host cores each engine replica uses.

With ``--data-parallel-size N`` the front-end (:class:`~chassis.core.dp_client.DataParallelClient`)
starts N engine cores, engine ``i`` with ``config.data_parallel_rank = i``. Each asks the
platform for its ranks' devices (:meth:`Platform.data_parallel_devices`: by default devices
``i*T .. (i+1)*T - 1`` for ``T = --tensor-parallel-size``; on the CPU every rank on the
host) and runs on an equal share of the host's cores (:func:`take_host_share`: torch
threads), which its tensor-parallel ranks then split among themselves. With one engine
nothing changes: :meth:`Platform.tensor_parallel_devices` places the ranks, and the process
uses every core.
"""

from __future__ import annotations

import logging
import os

import torch

from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)


def engine_rank_devices(config: EngineConfig) -> list[int]:
    """The local device index of each tensor-parallel rank of the engine ``config`` is for
    (rank ``r`` uses entry ``r``; pipeline stages are ranks too); ``ValueError`` when the
    host has too few devices."""
    from chassis.platforms import get_current_platform

    platform = get_current_platform()
    size = config.world_size
    if config.pipeline_parallel_size > 1:  # (the platform's message names tensor parallelism)
        try:
            return platform.tensor_parallel_devices(size)
        except ValueError as exc:
            raise ValueError(
                f"--pipeline-parallel-size {config.pipeline_parallel_size} runs {size} ranks: {exc}"
            ) from None
    if config.data_parallel_size == 1:
        return platform.tensor_parallel_devices(size)
    return platform.data_parallel_devices(
        config.data_parallel_rank, config.data_parallel_size, size
    )


def check_data_parallel(config: EngineConfig) -> None:
    """In the front-end, before any engine starts: ``ValueError`` when the host cannot give
    every engine its devices (the platform's message)."""
    if config.data_parallel_size > 1:
        engine_rank_devices(config)


def take_host_share(config: EngineConfig) -> None:
    """In an engine-core process of several (``data_parallel_size > 1``), before its model
    loads: size torch's thread pool to this engine's equal share of the host's cores
    (``cores // N``, at least 1), so that the N engines together run one thread per core
    (their tensor-parallel ranks split the share again: ``tp_executor.start_rank``).
    Nothing with one engine."""
    if config.data_parallel_size == 1:
        return
    threads = host_threads(config.data_parallel_size)
    torch.set_num_threads(threads)
    logger.info(
        "data-parallel engine %d of %d: %d torch thread(s)",
        config.data_parallel_rank,
        config.data_parallel_size,
        threads,
    )


def host_threads(num_processes: int) -> int:
    """An equal share of the cores this process may run on for each of ``num_processes``
    processes that compute on them (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // num_processes)


def refuse_offline_data_parallel(config: EngineConfig) -> None:
    """The offline ``LLM`` runs one engine in its own process: ``ValueError`` for
    ``data_parallel_size`` above 1, naming what runs several."""
    if config.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size}: the offline LLM runs one engine "
            "in this process; data parallelism needs engine-core processes: serve the model "
            "(chassis serve --data-parallel-size N) or use AsyncLLM with "
            "EngineConfig(data_parallel_size=N), or run one LLM per process"
        )
