"""EAGLE-3 with CUDA decode graphs: the target's kept hidden states come out of the graphs.

The whole engine on the GPU (``LLM``, ``triton_paged``, the CUDA platform's capture) over a
tiny four-layer random Llama (tests/fixtures_models.py) and a random EAGLE-3 head in the
published layout (tests/fixtures_eagle3.py), float32. ``min_tokens`` keeps drafts off for
the first tokens, so those steps are pure decodes that replay graphs; the head then runs over
the states the graphs wrote. Checked: graphs were captured and replayed with the head on, the
greedy output is plain decoding's and the eager EAGLE-3 engine's, and the proposals are the
eager engine's (all but rounding-level ties: graphs and eager steps may split the attention
differently).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures_eagle3 import write_eagle3_head
from fixtures_models import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=16)
PROMPTS = [[3 + (7 * i + 13 * j) % 4000 for j in range(5 + 9 * i)] for i in range(3)]


def _run(target: Path, **engine):
    from chassis import LLM, SamplingParams

    llm = LLM(str(target), **{**ENGINE, **engine})
    runner = llm.engine.executor.worker.runner
    seen: list[tuple[list[int], list[int]]] = []
    if runner.drafter is not None:
        propose = runner.drafter.propose

        def recording(batch, rows, *args):
            proposals = propose(batch, rows, *args)
            for request_id, drafts in proposals.items():
                r = batch.row_of[request_id]
                newest = int(batch.num_computed_tokens[r])
                seen.append((batch.token_ids[r, : newest + 1].tolist(), list(drafts)))
            return proposals

        runner.drafter.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    graphs = runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    aux = graphs is not None and graphs.aux_outputs is not None
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, seen, replays, aux


def test_eagle3_with_decode_graphs(tmp_path: Path) -> None:
    target = write_tiny_checkpoint("llama", tmp_path / "target", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head", layer_ids=[0, 2, 3])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    tokens, drafts, replays, aux = _run(target, cuda_graph_sizes=[1, 2, 4], speculative_config=spec)
    assert aux and replays >= 7, replays  # the min_tokens steps replayed, states kept
    eager_tokens, eager_drafts, eager_replays, _ = _run(
        target, enforce_eager=True, speculative_config=spec
    )
    assert eager_replays == 0
    plain_tokens, _, _, _ = _run(target, cuda_graph_sizes=[1, 2, 4])
    assert tokens == plain_tokens == eager_tokens
    assert len(drafts) == len(eager_drafts) > 6
    same = sum(a == b for a, b in zip(drafts, eager_drafts, strict=True))
    assert same >= 0.9 * len(drafts), (same, len(drafts))
