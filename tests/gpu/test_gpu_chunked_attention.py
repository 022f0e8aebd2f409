"""Llama 4's chunked local attention (``attention_chunk_size``) in ``triton_paged`` on a GPU
(run by tests/gpu/run_gpu_checks.sh's pytest step).

The kernel at Llama 4 Scout's attention shapes (40 query heads over 8 KV heads of 128, cache
blocks of 16) with Scout's chunks of 8192 and with chunks of 256, so that contexts of a few
thousand tokens cross several chunk boundaries: mixed steps (a prefill from scratch over
several chunks, chunks over cached prefixes that start inside a chunk, decodes at a chunk's
first and last position) in bf16 and fp32, and decode-only steps (one query block per
request, the variant decode graphs capture; queries of 2-3 tokens that straddle a boundary)
split over KV programs as chosen on this GPU, unsplit, and split 16 ways (splits past the
chunk's tiles are empty), against the dense float32 reference of tests/paged_attention_cases.py.
Then the engine on tests/test_llama4.py's tiny random Llama 4 (chunks of 8 on two of four
layers), float32, ``triton_paged`` with decode graphs: greedy tokens equal HF ``generate``'s
on the GPU, with whole prefills and with 16-token prefill chunks over prefix-cached blocks.
tests/test_triton_attention.py and tests/test_chunked_attention.py run the same kernel under
Triton's interpreter at small shapes.
"""

from __future__ import annotations

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

#: Llama 4 Scout's attention (and Maverick's): 40 query heads over 8 KV heads of 128
SCOUT = dict(num_heads=40, num_kv_heads=8, head_dim=128, block_size=16)
SCALE = 128**-0.5
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}

#: (cached prefix, query length) per request of a mixed step, per chunk size
MIXED = {
    # a prefill over chunks 0-2; a chunk over a prefix that starts inside chunk 3 and ends in
    # chunk 5; decodes at the last position of a chunk (1023, 2047) and at the first (1024);
    # a chunk inside chunk 9 that crosses into chunk 10; decodes far on and at position 0
    256: [(0, 700), (1000, 300), (1023, 1), (1024, 1), (2047, 1), (2500, 64), (3000, 1), (0, 1)],
    # Scout's chunk: a chunk over a prefix in chunk 0 that crosses into chunk 1; a prefill
    # within chunk 0; decodes at 8191 (last of chunk 0) and 8192 (first of chunk 1); a chunk
    # in chunk 2 (a context of 16,540)
    8192: [(8000, 300), (0, 200), (8191, 1), (8192, 1), (5000, 1), (16500, 40)],
}
#: decode-only steps: one query block per request (at most 3 tokens for a GQA group of 5);
#: the 3-token queries at 254 / 8190 and the 2-token ones straddle a chunk boundary
DECODES = {
    256: [(255, 1), (256, 1), (254, 3), (1000, 1), (2047, 1), (3000, 1), (17, 1), (4095, 2)],
    8192: [(8191, 1), (8192, 1), (8190, 3), (9000, 1), (16384, 1), (17000, 1), (16383, 2)],
}


@pytest.mark.parametrize("chunk", [256, 8192], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_chunked_mixed_step_matches_dense(chunk: int, dtype: torch.dtype) -> None:
    """Prefill chunks over cached prefixes beside decodes, through the backend's forward
    (KV write, then the kernel): keys before each query's chunk start are hidden (slots no
    request owns hold NaN, so a read past a sequence shows)."""
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    batch = make_batch(MIXED[chunk], **SCOUT, dtype=dtype, device="cuda", num_pad_tokens=2, seed=7)
    backend = TritonPagedAttention(40, 128, 8, SCALE, attention_chunk_size=chunk)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    torch.cuda.synchronize()
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, SCALE, attention_chunk_size=chunk)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)
    # not vacuous: without the chunks the answer is another
    assert not torch.allclose(expected, dense_attention(batch, SCALE), atol=0.05)


@pytest.mark.parametrize("num_splits", [None, 1, 16], ids=["auto", "unsplit", "split16"])
@pytest.mark.parametrize("chunk", [256, 8192], ids=lambda c: f"chunk{c}")
def test_triton_chunked_decodes_match_dense(chunk: int, num_splits: int | None) -> None:
    """bf16 decode-only steps, split over KV programs as this GPU's multiprocessor count
    makes ``choose_launch_config`` choose (more than one: 7 or 8 requests leave it idle, and the
    chunk bounds what is worth splitting), unsplit, and 16 ways (more splits than a chunk of
    256 has tiles); each against the dense reference."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(DECODES[chunk], **SCOUT, dtype=torch.bfloat16, device="cuda", seed=3)
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    config = kernels.paged_attention(
        batch.query,
        batch.kv_cache,
        out,
        num_splits=num_splits,
        attention_chunk_size=chunk,
        **batch.kernel_args(SCALE),
    )
    torch.cuda.synchronize()
    assert batch.metadata.max_query_len <= config.block_q  # one block per request
    if num_splits is None:
        assert config.num_splits > 1, config
    else:
        assert config.num_splits == num_splits
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, SCALE, attention_chunk_size=chunk)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)


#: prompt lengths (token ids): up to six chunks of 8 with the new tokens; 29 and 40 leave a
#: cached prefix that ends inside a chunk (28, 36) when their blocks of 4 come from the cache
PROMPT_LENS = (5, 17, 40, 3, 29)


@pytest.mark.parametrize("prefill", ["whole", "chunked-cached"])
def test_engine_on_a_tiny_llama4_matches_hf_greedy(tmp_path: Path, prefill: str) -> None:
    """float32, ``triton_paged`` with decode graphs (the chunked variant captured). ``whole``:
    default token budget, each prompt prefilled in one step. ``chunked-cached``: 16-token
    steps over blocks of 4 with prefix caching, the prompts run twice, the second time from
    the cache (chunks over cached prefixes that start inside an attention chunk)."""
    from fixtures_models import save_tiny_checkpoint
    from test_gpu_engine import NEW_TOKENS, hf_greedy
    from test_llama4 import tiny_config

    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    model_dir = save_tiny_checkpoint(tiny_config(), tmp_path / "tiny_llama4", seed=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts, "cuda")
    engine: dict = {}
    if prefill == "chunked-cached":
        engine = dict(max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        attention_backend="triton_paged",
        max_model_len=256,
        gpu_memory_utilization=0.2,
        **engine,
    )
    try:
        layers = llm.engine.executor.worker.runner.model.model.layers
        chunks = [layer.self_attn.attn.attention_chunk_size for layer in layers]
        assert chunks == [8, None, 8, None]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts]
        for run in range(2 if prefill == "chunked-cached" else 1):
            outputs = llm.generate(requests, params)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected
            if run:
                assert sum(o.num_cached_tokens for o in outputs) > 0
        graphs = llm.engine.executor.worker.runner.graphs
        assert graphs is not None, "decode graphs were not captured"
        assert graphs.num_replays > 0
    finally:
        llm.shutdown()
