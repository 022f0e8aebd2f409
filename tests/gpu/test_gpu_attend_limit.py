"""``attend_limit`` (Gemma 3's bidirectional image blocks) in ``triton_paged`` on a GPU, at
gemma-3-4b's attention shapes (8 query heads over 4 KV heads of 256, cache blocks of 16),
against a dense float32 reference (run by tests/gpu/run_gpu_checks.sh's pytest step).

A mixed step: a prefill whose chunk holds a whole 256-token image, a chunk over a cached
prefix that starts inside an image and ends after it, decodes beside them; with no window
and with Gemma 3's sliding window of 1024 (HF's ``sliding AND (causal OR block)``) and a
shorter one that cuts into the images. tests/test_attend_limit.py runs the same kernel under
Triton's interpreter at small shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from paged_attention_cases import make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

#: (cached prefix, query length) per request, and each one's image blocks [begin, end)
SPECS = [(0, 300), (100, 260), (511, 1), (0, 1), (33, 280)]
BLOCKS = [[(10, 266)], [(50, 306)], [], [], [(40, 296)]]
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 256
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _limits(device: str) -> torch.Tensor:
    limits: list[int] = []
    for (prefix, query_len), blocks in zip(SPECS, BLOCKS, strict=True):
        for pos in range(prefix, prefix + query_len):
            inside = [end - 1 for begin, end in blocks if begin <= pos < end]
            limits.append(inside[0] if inside else pos)
    return torch.tensor([*limits, 0, 0], dtype=torch.int32, device=device)


def _dense(batch, limit: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    outs, start = [], 0
    for prefix, query_len, ctx_k, ctx_v in batch.contexts:
        q = batch.query[start : start + query_len].float().cpu()
        last = limit[start : start + query_len].long().cpu()[:, None]
        start += query_len
        group = q.shape[1] // ctx_k.shape[1]
        k = ctx_k.float().cpu().repeat_interleave(group, dim=1)
        v = ctx_v.float().cpu().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = prefix + torch.arange(query_len)[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        visible = k_pos <= last
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1024, 100], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_attend_limit_matches_dense(window: int | None, dtype: torch.dtype) -> None:
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    batch = make_batch(
        SPECS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=16,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=2,
        seed=5,
        unwritten_fill=1e4,
    )
    limit = _limits("cuda")
    batch.metadata.attend_limit = limit
    scale = HEAD_DIM**-0.5
    backend = TritonPagedAttention(HEADS, HEAD_DIM, KV_HEADS, scale, sliding_window=window)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    torch.cuda.synchronize()
    n = batch.metadata.num_actual_tokens
    expected = _dense(batch, limit, scale, window)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)
