"""MLA prefill, absorbed vs expanded (``builtin_plugins/models/mla_prefill.py``): the FLOP
ratio of the two forms at DeepSeek-V3's attention shapes, and the CPU time of one attention
layer running a single prefill each way; the tables in docs/models.md, "DeepSeek-V2, V3
and GLM-4.5".

    python tests/perf/mla_prefill_flops.py [--lengths 128 512 2048] [--heads 16]

FLOPs are per head (the count of heads cancels in the ratio) by the cost model ``auto``
decides with (``absorbed_flops`` / ``expanded_flops``). The timed layer is the real
``MultiHeadLatentAttention`` with V3's attention widths (latent 512 + rope 64, nope 128,
v 128) and ``--heads`` heads (16: one rank of V3 on 8 GPUs), random float32 weights,
``torch_paged``, blocks of 16. What both forms share (the q, latent and output projections
from and to the hidden state) is shrunk to a hidden size of 256 without ``q_lora_rank``, so
the time is what differs: absorption and latent-wide attention, or expansion and
192/128-wide attention (at V3's hidden 7168 the projections cost about 69 MFLOP per token
per layer on 16 heads, the same both ways).
"""

from __future__ import annotations

import argparse
import time

import torch

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.deepseek_v2 import MlaSpec, MultiHeadLatentAttention
from chassis.builtin_plugins.models.mla_prefill import MlaShape, absorbed_flops, expanded_flops
from chassis.core.attention import AttentionMetadata, ForwardContext, alias_kv_planes
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

V3 = MlaShape(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BLOCK = 16
#: the hidden size of the timed layer (small: see the module docstring)
HIDDEN = 256
#: (cached prefix, query tokens) rows of the FLOP table
FLOP_CASES = [
    *((0, n) for n in (16, 128, 512, 2048, 8192, 32768)),
    (4096, 4),
    (4096, 64),
    (4096, 256),
    (4096, 1024),
]


def flop_table() -> None:
    print("| cached prefix | query tokens | absorbed GFLOP/head | expanded GFLOP/head | ratio |")
    print("|---|---|---|---|---|")
    for prefix, query in FLOP_CASES:
        absorbed = absorbed_flops(V3, query, prefix + query)
        expanded = expanded_flops(V3, query, prefix + query)
        print(
            f"| {prefix} | {query} | {absorbed / 1e9:.3f} | {expanded / 1e9:.3f} | "
            f"{absorbed / expanded:.2f} |"
        )


def build_layer(heads: int) -> MultiHeadLatentAttention:
    spec = MlaSpec(
        hidden_size=HIDDEN,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=V3.kv_lora_rank,
        qk_nope_head_dim=V3.qk_nope_head_dim,
        qk_rope_head_dim=V3.qk_rope_head_dim,
        v_head_dim=V3.v_head_dim,
        attention_bias=False,
        scale=192**-0.5,
    )
    rotary = RotaryEmbedding(
        64, 8192, {"rope_type": "default", "rope_theta": 10000.0, "interleaved": True}
    )
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    layer = MultiHeadLatentAttention(spec, rotary, 0, ctx)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return layer


def prefill_step(length: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """One request prefilling ``length`` tokens into blocks ``0 ..``: metadata and cache."""
    blocks = -(-length // BLOCK)
    starts = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=length,
        num_reqs=1,
        query_start_loc=starts,
        seq_lens=lens,
        block_table=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(length, dtype=torch.int64),
        max_query_len=length,
        max_seq_len=length,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    cache = alias_kv_planes(torch.zeros(blocks, 1, BLOCK, 1, 576))
    return metadata, cache


def time_layer(
    layer: MultiHeadLatentAttention, length: int, mode: str, reps: int
) -> tuple[float, float]:
    """The fastest of ``reps`` forwards over a ``length``-token prefill in ``mode``: (wall
    seconds, process CPU seconds, all threads). The minimum: other processes on a shared
    machine only ever add time."""
    layer.prefill_mode = mode
    metadata, cache = prefill_step(length)
    hidden = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length)
    walls, cpus = [], []
    with torch.no_grad():
        for _ in range(reps + 1):  # the first is a warm-up
            metadata.derived.clear()
            ctx = ForwardContext(metadata, [cache])
            wall, cpu = time.perf_counter(), time.process_time()
            layer(positions, hidden, ctx)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return min(walls[1:]), min(cpus[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    flop_table()
    layer = build_layer(args.heads)
    print(f"\nCPU, one layer, {args.heads} heads, {torch.get_num_threads()} threads, float32")
    print("| prompt tokens | absorbed ms (CPU ms) | expanded ms (CPU ms) | ratio wall (CPU) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        a_wall, a_cpu = time_layer(layer, length, "absorbed", args.reps)
        e_wall, e_cpu = time_layer(layer, length, "expanded", args.reps)
        print(
            f"| {length} | {a_wall * 1e3:.0f} ({a_cpu * 1e3:.0f}) | "
            f"{e_wall * 1e3:.0f} ({e_cpu * 1e3:.0f}) | "
            f"{a_wall / e_wall:.2f} ({a_cpu / e_cpu:.2f}) |"
        )


if __name__ == "__main__":
    main()
