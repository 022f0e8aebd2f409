"""The latency of one gloo all-reduce between two processes on this host (docs/performance.md).

Not a test. Two processes join a gloo group over loopback, one thread each, and time 500
all-reduces of a 32x64 float32 tensor (a decode step's hidden states at batch 32 of the tiny
config) after 50 warm-up ones::

    python tests/perf/gloo_latency.py
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, rendezvous: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    tensor = torch.randn(32, 64)
    for _ in range(50):
        dist.all_reduce(tensor)
    calls = 500
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"all_reduce [32, 64] float32: {elapsed / calls * 1e6:.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_rank, args=(os.path.join(directory, "rendezvous"),), nprocs=2)
