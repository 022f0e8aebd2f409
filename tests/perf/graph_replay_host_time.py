"""Host time of one decode-graph replay's input staging, on the CPU.

``DecodeGraphs.run`` with the test platform whose "graph" re-runs a trivial forward eagerly
(tests/test_cuda_graphs.py's ``GraphTestPlatform``): what remains is filling and copying the
static inputs, the part of a GPU step's host time this file's subject changes (on a GPU each
copy also pins its staging, which the CPU does not). Not a test. ``--module FILE`` loads
another ``cuda_graphs.py`` (e.g. an older one from ``git show REV:core/cuda_graphs.py``) and
times it alternately with the current one, best of five rounds each::

    python tests/perf/graph_replay_host_time.py [--module /tmp/old_cuda_graphs.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cuda_graphs import GraphTestPlatform

from chassis.core import cuda_graphs


class _Trivial(torch.nn.Module):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: object
    ) -> torch.Tensor:
        return input_ids[:, None].float()


def _replay_us(module: ModuleType, num_reqs: int, replays: int = 2000) -> float:
    graphs = module.DecodeGraphs(
        _Trivial(), [], GraphTestPlatform(), [1, 2, 4, 8], device=torch.device("cpu"),
        max_model_len=4096, max_blocks_per_req=256,
    )  # fmt: skip
    graphs.capture()
    ids = np.arange(num_reqs)
    positions = ids + 600
    slots = ids + 1000
    seq_lens = (positions + 1).astype(np.int32)
    table = np.zeros((num_reqs, 38), np.int32)  # 600-token contexts in 16-token blocks
    with torch.inference_mode():
        for _ in range(100):
            graphs.run(ids, positions, slots, seq_lens, table)
        start = time.perf_counter()
        for _ in range(replays):
            graphs.run(ids, positions, slots, seq_lens, table)
    return (time.perf_counter() - start) / replays * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", type=Path, help="another cuda_graphs.py to time alongside")
    args = parser.parse_args()
    modules = {"current": cuda_graphs}
    if args.module is not None:
        spec = importlib.util.spec_from_file_location("other_cuda_graphs", args.module)
        assert spec is not None and spec.loader is not None
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        modules[str(args.module)] = other
    for num_reqs in (1, 8):
        best = {name: min(_replay_us(m, num_reqs) for _ in range(5)) for name, m in modules.items()}
        print(f"{num_reqs} requests: " + ", ".join(f"{k} {v:.1f} us" for k, v in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
