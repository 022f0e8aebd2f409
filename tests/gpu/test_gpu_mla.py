"""DeepSeek's MLA latent cache on a GPU (run by tests/gpu/run_gpu_checks.sh's pytest step).

The ``triton_paged`` kernel at DeepSeek shapes on a one-plane cache whose V plane aliases
its K plane (one KV head of 576 shared by all query heads: 128 for DeepSeek-V3 on one GPU,
16 for V3 over 8, 16 for V2-Lite), against the dense float32 reference; then the whole engine
on a tiny DeepSeek-V2 checkpoint: greedy tokens equal HF ``generate``'s on the GPU, with the
expanded prefill as chosen by default and forced for every chunk.
CPU versions of both run in tests/test_mla_latent_cache.py (the kernel under Triton's
interpreter, at small shapes).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from paged_attention_cases import dense_attention, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

#: prefills over cached prefixes and decodes over contexts of many lengths (cache blocks of 16)
MIXED = [(0, 64), (100, 17), (511, 1), (0, 1), (1500, 1), (33, 40), (2047, 1)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("num_heads", [128, 16], ids=lambda h: f"{h}heads")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_on_the_latent_cache_matches_dense(num_heads: int, dtype: torch.dtype) -> None:
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention
    from chassis.core.attention import alias_kv_planes

    head_dim = 576
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=3,
    )
    # the latent is both key and value: one plane, aliased
    contexts = [(p, q, k, k) for p, q, k, _ in batch.contexts]
    batch = dataclasses.replace(batch, value=batch.key, contexts=contexts)
    cache = alias_kv_planes(batch.kv_cache[:, :1].clone())
    assert cache.stride(1) == 0
    scale = 192**-0.5  # DeepSeek's qk_head_dim, not the cache width
    backend = TritonPagedAttention(num_heads, head_dim, 1, scale)
    out = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata)
    torch.cuda.synchronize()
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("prefill", ["auto", "expanded"])
def test_engine_on_a_tiny_deepseek_matches_hf_greedy(tmp_path, monkeypatch, prefill) -> None:
    """float32, ``triton_paged`` with decode graphs; a small token budget mixes chunked
    prefills with decodes. ``CHASSIS_MLA_PREFILL``: ``auto`` (at this checkpoint's widths,
    values of 32 > latent 16, the cost rule keeps every request absorbed) and ``expanded``
    (every chunk expanded, SDPA on the GPU; the decodes of a mixed step on ``triton_paged``
    over metadata of their own: ``builtin_plugins/models/mla_prefill.py``)."""
    monkeypatch.setenv("CHASSIS_MLA_PREFILL", prefill)
    from test_deepseek_models import write_checkpoint
    from test_gpu_engine import NEW_TOKENS, PROMPT_LENS, hf_greedy

    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    model_dir = write_checkpoint("v2_lite", tmp_path / "tiny_deepseek")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts, "cuda")
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        attention_backend="triton_paged",
        max_model_len=256,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.2,
    )
    try:
        runner = llm.engine.executor.worker.runner
        assert runner.kv_planes == 1 and all(c.stride(1) == 0 for c in runner.kv_caches)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
