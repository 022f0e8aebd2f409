"""Decode steps replayed from CUDA graphs give the same greedy tokens as eager steps.

The whole engine on the GPU (``LLM``, model runner, ``triton_paged``, the CUDA platform's
capture) on the tiny random Qwen3 of test_gpu_engine.py, float32, no tokenizer. The graph
engine captures batch sizes 1, 2, 4, 8 (so batches of 3 and 5 are padded); the other runs
with ``enforce_eager=True``. Prompts of mixed lengths up to 300 tokens with
``max_model_len=512`` make the captured split-KV configuration (chosen for 512 tokens) replay
over contexts of very different lengths. Also checked: the graphs were really replayed
(``DecodeGraphs.replays``), and a replay makes no device->host synchronization; and the same
with the graph engine built under CHASSIS_FUSED_DECODE_ATTENTION=1.
"""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_gpu_engine import VOCAB, divergence_report, write_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

NEW_TOKENS = 12
PROMPT_LENS = (5, 300, 17, 64, 3)
ENGINE = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    max_model_len=512,
    num_kv_blocks=256,  # fixed: two engines live in this process at once
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_qwen3_graphs")
    write_tiny_qwen3(directory)
    return directory


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from chassis.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def _free_gpu_memory() -> None:
    """Return the engines' memory (caches, graph pools), so later tests size as if alone."""
    gc.collect()
    torch.cuda.empty_cache()


def test_graph_replay_matches_eager_greedy(model_dir: Path) -> None:
    _check_graph_replay_matches_eager(model_dir)  # engines die with its frame
    _free_gpu_memory()


def test_fused_decode_graph_replay_matches_eager_greedy(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph engine built under CHASSIS_FUSED_DECODE_ATTENTION=1 (decode steps write their
    K/V and merge their KV splits inside the attention kernel; padding rows of the padded
    batches write nothing) against the eager engine without it: the same greedy tokens."""
    _check_graph_replay_matches_eager(model_dir, monkeypatch)
    _free_gpu_memory()


def test_every_opt_in_graph_replay_matches_eager_greedy(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph engine built with both opt-ins, CHASSIS_FUSED_DECODE_ATTENTION=1 and
    CHASSIS_TRITON_GEMV=1 (the small-batch GEMV, with SwiGLU's activation and the
    post-attention norm folded into its launches), against the plain eager engine: the same
    greedy tokens (float32 sums in another order; the tiny model's top logits are far apart)."""
    _check_graph_replay_matches_eager(model_dir, monkeypatch, gemv=True)
    _free_gpu_memory()


def _attention_backend(llm):
    """The attention backend of the engine's first attention layer (the engine runs in this
    process)."""
    from chassis.core.layers.attention import Attention

    model = llm.engine.executor.worker.runner.model
    return next(module.backend for module in model.modules() if isinstance(module, Attention))


def _check_graph_replay_matches_eager(
    model_dir: Path, fused: pytest.MonkeyPatch | None = None, gemv: bool = False
) -> None:
    """``fused``: build the graph engine with CHASSIS_FUSED_DECODE_ATTENTION=1 (set and
    unset through it), and with ``gemv`` CHASSIS_TRITON_GEMV=1 too; the eager one without."""
    from chassis.core.llm import LLM
    from chassis.platforms.cuda_small_batch_linear import small_batch_layers

    if fused is not None:
        fused.setenv("CHASSIS_FUSED_DECODE_ATTENTION", "1")
        if gemv:
            fused.setenv("CHASSIS_TRITON_GEMV", "1")
    graphs_llm = LLM(str(model_dir), cuda_graph_sizes=[1, 2, 4, 8], **ENGINE)
    if fused is not None:
        fused.delenv("CHASSIS_FUSED_DECODE_ATTENTION")
        fused.delenv("CHASSIS_TRITON_GEMV", raising=False)
        assert _attention_backend(graphs_llm).fused_decode
        model = graphs_llm.engine.executor.worker.runner.model
        assert bool(small_batch_layers(model)) == gemv
    eager_llm = LLM(str(model_dir), enforce_eager=True, **ENGINE)
    assert fused is None or not _attention_backend(eager_llm).fused_decode
    assert graphs_llm.engine.info.platform in ("cuda", "rocm")
    assert graphs_llm.config.attention_backend == "triton_paged"
    runner = graphs_llm.engine.executor.worker.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    assert eager_llm.engine.executor.worker.runner.graphs is None
    rng = random.Random(0)
    for num_prompts, bucket in ((1, 1), (3, 4), (5, 8)):
        prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS[:num_prompts]]
        runner.graphs.replays.clear()
        got = _greedy(graphs_llm, prompts)
        eager = _greedy(eager_llm, prompts)
        assert got == eager, (
            f"batch of {num_prompts}: {divergence_report(model_dir, prompts, eager, got)}"
        )
        # all prompts prefill in the first step; every later step is a decode
        assert runner.graphs.replays == {bucket: NEW_TOKENS - 1}, num_prompts


def test_replay_makes_no_host_sync(model_dir: Path) -> None:
    _check_replay_makes_no_host_sync(model_dir)
    _free_gpu_memory()


def _check_replay_makes_no_host_sync(model_dir: Path) -> None:
    from chassis.core.llm import LLM

    llm = LLM(str(model_dir), cuda_graph_sizes=[4], **ENGINE)
    graphs = llm.engine.executor.worker.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    block_size = llm.config.block_size
    positions = np.array([0, 10, 200], dtype=np.int64)
    block_table = np.arange(3 * 13, dtype=np.int32).reshape(3, 13)  # blocks 0..38, unused
    blocks = block_table[np.arange(3), positions // block_size]
    args = (
        np.array([5, 6, 7], dtype=np.int64),  # input ids
        positions,
        blocks.astype(np.int64) * block_size + positions % block_size,  # slots
        (positions + 1).astype(np.int32),  # seq lens
        block_table,
    )
    with torch.inference_mode():
        graphs.run(*args)  # pinned staging memory is allocated before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = graphs.run(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert hidden.shape[0] == 3 and bool(torch.isfinite(hidden).all())
    assert graphs.replays == {4: 2}
