"""Timings of ``triton_paged`` (and the fused ops) at Qwen3-0.6B shapes; prints a table.

Not a test: run by tests/gpu/run_gpu_checks.sh after the GPU tests, to record numbers that
later tuning compares against. Each line: case, microseconds per call (median of
``triton.testing.do_bench``), and for decode the KV bytes read per second (also with an fp8
KV cache, ``--kv-cache-dtype fp8``). Then decode steps as the engine runs them, 28 layers
(each its own cache) replayed from one CUDA graph, with the K/V write and split merge as
separate kernels and fused into the attention kernel (``CHASSIS_FUSED_DECODE_ATTENTION=1``):
microseconds per layer, launch gaps included.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention
from chassis.core.attention import AttentionMetadata
from chassis.core.layers import fused_ops, triton_ops

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16


def step(prefixes: list[int], query_len: int) -> tuple[tuple, int]:
    """Backend.forward arguments for requests with these cached prefixes, ``query_len`` each."""
    dev = "cuda"
    seq_lens = [p + query_len for p in prefixes]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    table = torch.zeros(len(prefixes), max(blocks), dtype=torch.int32, device=dev)
    slots, start = [], 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start : start + n]
        start += n
        pos = torch.arange(seq_lens[i] - query_len, seq_lens[i], device=dev)
        slots.append(table[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK)
    tokens = len(prefixes) * query_len
    qsl = torch.arange(0, tokens + 1, query_len, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=tokens,
        num_reqs=len(prefixes),
        query_start_loc=qsl.to(dev),
        seq_lens=lens.to(dev),
        block_table=table,
        slot_mapping=torch.cat(slots),
        max_query_len=query_len,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    q = torch.randn(tokens, HEADS, DIM, device=dev, dtype=DTYPE)
    k = torch.randn(tokens, KV_HEADS, DIM, device=dev, dtype=DTYPE)
    v = torch.randn_like(k)
    cache = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, DIM, device=dev, dtype=DTYPE)
    kv_bytes = sum(seq_lens) * 2 * KV_HEADS * DIM * cache.element_size()
    return (q, k, v, cache, meta), kv_bytes


def graph_us_per_call(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Microseconds per call of ``calls``, captured in order into one CUDA graph and replayed
    (median of ``replays``): device time with the launch gaps a decode step's graph has,
    without Python. Each call runs once first on the capture stream (compiles, allocates that
    stream's split counters)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def fused_decode_lines(layers: int = 28) -> None:
    """Decode steps of ``layers`` layers in one graph, separate kernels vs fused, per layer."""
    separate = TritonPagedAttention(HEADS, DIM, KV_HEADS, DIM**-0.5)
    fused = TritonPagedAttention(HEADS, DIM, KV_HEADS, DIM**-0.5)
    separate.fused_decode, fused.fused_decode = False, True
    for batch, ctx in [(1, 600), (1, 4096), (8, 1024), (64, 1024)]:
        steps = [step([ctx] * batch, 1)[0] for _ in range(layers)]  # a cache per layer
        config = kernels.choose_launch_config(
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            num_tokens=batch,
            num_reqs=batch,
            max_query_len=1,
            max_seq_len=ctx + 1,
            device=torch.device("cuda"),
        )
        us = {
            name: graph_us_per_call([partial(backend.forward, *args) for args in steps])
            for name, backend in (("separate", separate), ("fused", fused))
        }
        print(
            f"decode graph {layers} layers B={batch:<3} ctx={ctx:<5} splits {config.num_splits:<2} "
            f"separate {us['separate']:7.2f} us/layer  fused {us['fused']:7.2f} us/layer  "
            f"({us['fused'] / us['separate']:.2f}x)",
            flush=True,
        )
        del steps
        torch.cuda.empty_cache()


def _dense_causal(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


def main() -> None:
    torch.manual_seed(0)
    triton_backend = TritonPagedAttention(HEADS, DIM, KV_HEADS, DIM**-0.5)
    torch_backend = TorchPagedAttention(HEADS, DIM, KV_HEADS, DIM**-0.5)
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, "
        f"{HEADS}/{KV_HEADS} heads, dim {DIM}, block {BLOCK}"
    )
    for batch, ctx in [(1, 1024), (1, 8192), (16, 1024), (64, 1024), (256, 1024), (64, 4096)]:
        args, kv_bytes = step([ctx] * batch, 1)
        us = do_bench(lambda a=args: triton_backend.forward(*a)) * 1e3
        line = f"decode  B={batch:<4} ctx={ctx:<5} triton {us:8.1f} us  {kv_bytes / us / 1e3:7.1f} GB/s"
        if batch <= 64:
            ref_us = do_bench(lambda a=args: torch_backend.forward(*a)) * 1e3
            line += f"   torch_paged {ref_us:8.1f} us"
        print(line, flush=True)
    # --kv-cache-dtype fp8: the same decodes reading half the bytes (e4m3 cache, bf16 compute)
    for batch, ctx in [(1, 8192), (64, 1024), (256, 1024), (64, 4096)]:
        (q, k, v, cache, meta), kv_bytes = step([ctx] * batch, 1)
        args = (q, k, v, cache.to(torch.float8_e4m3fn), meta)
        us = do_bench(lambda a=args: triton_backend.forward(*a)) * 1e3
        print(
            f"decode  B={batch:<4} ctx={ctx:<5} triton fp8 cache {us:8.1f} us  "
            f"{kv_bytes / 2 / us / 1e3:7.1f} GB/s",
            flush=True,
        )
    for reqs, prefix, q_len in [(1, 0, 2048), (4, 512, 512), (16, 0, 256)]:
        args, _ = step([prefix] * reqs, q_len)
        us = do_bench(lambda a=args: triton_backend.forward(*a)) * 1e3
        q = torch.randn(reqs, HEADS, prefix + q_len, DIM, device="cuda", dtype=DTYPE)
        kv = torch.randn(reqs, KV_HEADS, prefix + q_len, DIM, device="cuda", dtype=DTYPE)
        sdpa_us = do_bench(partial(_dense_causal, q, kv)) * 1e3
        print(
            f"prefill reqs={reqs:<3} prefix={prefix:<4} q={q_len:<5} triton {us:8.1f} us   "
            f"SDPA dense causal over prefix+q {sdpa_us:8.1f} us",
            flush=True,
        )
    fused_decode_lines()
    x = torch.randn(256, 1024, device="cuda", dtype=DTYPE)
    r, w = torch.randn_like(x), torch.ones(1024, device="cuda", dtype=DTYPE)
    fused = do_bench(lambda: triton_ops.rms_norm(x, w, 1e-6, r)) * 1e3
    ref = do_bench(lambda: fused_ops.rms_norm_ref(x, w, 1e-6, r)) * 1e3
    print(f"add+rms_norm [256, 1024]  triton {fused:6.1f} us   torch {ref:6.1f} us")
    g = torch.randn(256, 2 * 3072, device="cuda", dtype=DTYPE)
    fused = do_bench(lambda: triton_ops.silu_and_mul(g)) * 1e3
    ref = do_bench(lambda: fused_ops.silu_and_mul_ref(g)) * 1e3
    print(f"silu_and_mul [256, 6144]  triton {fused:6.1f} us   torch {ref:6.1f} us")


if __name__ == "__main__":
    main()
