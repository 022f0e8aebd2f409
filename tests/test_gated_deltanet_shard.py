"""Gated DeltaNet's tensor-parallel cut (:mod:`chassis.core.layers.gated_deltanet_shard`),
in one process: the ranks' parts of each checkpoint tensor put together are the whole
tensor, and the ranks' layers (built at the local sizes, loaded with their parts) give
outputs that sum to the whole layer's, over two steps that carry the state (a prefill beside
a decode, then decodes), their states being the whole layer's states' heads. Two real ranks
through ``LLM``: ``test_state_space_tp``.
"""

from __future__ import annotations

import pytest
import torch
from fixtures_models import make_attention_metadata

from chassis.core.attention import ForwardContext
from chassis.core.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from chassis.core.layers.gated_deltanet_shard import gated_deltanet_shard

#: 4 key heads of 8, 8 value heads of 6 (two per group), conv window 4
SPEC = GatedDeltaNetSpec(
    hidden_size=24,
    num_k_heads=4,
    num_v_heads=8,
    k_head_dim=8,
    v_head_dim=6,
    conv_kernel=4,
    norm_eps=1e-6,
    chunk_size=4,
)


def random_layer(spec: GatedDeltaNetSpec) -> GatedDeltaNet:
    gen = torch.Generator().manual_seed(3)
    layer = GatedDeltaNet(spec, state_index=0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return layer


def run(layer: GatedDeltaNet, pool: list[torch.Tensor], steps: list) -> list[torch.Tensor]:
    """Each ``(hidden, query_lens, seq_lens)`` step over slots 0.. of ``pool``."""
    outs = []
    for hidden, query_lens, seq_lens in steps:
        metadata = make_attention_metadata(query_lens, seq_lens, [[0]] * len(query_lens), 16)
        slots = torch.arange(len(query_lens))
        ctx = ForwardContext(metadata, [], request_states=pool, state_slots=slots)
        with torch.no_grad():
            outs.append(layer(hidden, ctx))
    return outs


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_sum_to_the_whole_layer(size: int) -> None:
    whole = random_layer(SPEC)
    gen = torch.Generator().manual_seed(4)
    steps = [
        (torch.randn(7, SPEC.hidden_size, generator=gen), [6, 1], [6, 1]),
        (torch.randn(2, SPEC.hidden_size, generator=gen), [1, 1], [7, 2]),
    ]

    def pool_for(layer: GatedDeltaNet) -> list[torch.Tensor]:
        return [torch.zeros(2, *s.shape) for s in layer.state_specs("l", torch.float32)]

    whole_pool = pool_for(whole)
    expected = run(whole, whole_pool, steps)
    totals = [torch.zeros_like(e) for e in expected]
    params = dict(whole.named_parameters())
    for rank in range(size):
        shard = gated_deltanet_shard(SPEC, size, rank)
        local = GatedDeltaNet(shard.local, state_index=0)  # (one process: tp_size 1)
        with torch.no_grad():
            for name, param in local.named_parameters():
                param.copy_(shard.checkpoint_part(name, params[name], name))
        pool = pool_for(local)
        for total, out in zip(totals, run(local, pool, steps), strict=True):
            total += out
        # this rank's value heads of the delta-rule state
        heads = slice(shard.first_v_head, shard.first_v_head + shard.local.num_v_heads)
        torch.testing.assert_close(pool[1], whole_pool[1][:, heads])
    for total, want in zip(totals, expected, strict=True):
        torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_checkpoint_parts_cover_the_whole_tensor() -> None:
    """The fused projections by whole groups (contiguous rows), the conv's q, k and v
    channels of the rank's heads, per-head vectors split, ``out_proj`` by columns, the norm
    whole; a fused tensor of the wrong height is refused."""
    parts = [gated_deltanet_shard(SPEC, 2, rank) for rank in range(2)]
    qkvz = torch.arange(2 * SPEC.key_dim + 2 * SPEC.value_dim)[:, None]
    ba = torch.arange(2 * SPEC.num_v_heads)[:, None]
    for leaf, tensor in [("in_proj_qkvz.weight", qkvz), ("in_proj_ba.weight", ba)]:
        cuts = [p.checkpoint_part(leaf, tensor, leaf) for p in parts]
        assert torch.equal(torch.cat(cuts), tensor)
    conv = torch.arange(SPEC.conv_dim)[:, None, None]
    rank1 = parts[1].checkpoint_part("conv1d.weight", conv, "c")[:, 0, 0].tolist()
    k_half, v_half = SPEC.key_dim // 2, SPEC.value_dim // 2
    assert rank1 == [
        *range(k_half, SPEC.key_dim),  # q of key heads 2, 3
        *range(SPEC.key_dim + k_half, 2 * SPEC.key_dim),  # their k
        *range(2 * SPEC.key_dim + v_half, SPEC.conv_dim),  # v of value heads 4..7
    ]
    a_log = torch.arange(SPEC.num_v_heads)
    assert torch.equal(torch.cat([p.checkpoint_part("A_log", a_log, "a") for p in parts]), a_log)
    out = torch.arange(3 * SPEC.value_dim).reshape(3, -1)
    cuts = [p.checkpoint_part("out_proj.weight", out, "o") for p in parts]
    assert torch.equal(torch.cat(cuts, 1), out)
    norm = torch.ones(SPEC.v_head_dim)
    assert parts[1].checkpoint_part("norm.weight", norm, "n") is norm
    with pytest.raises(ValueError, match="rows, expected"):
        parts[0].checkpoint_part("in_proj_qkvz.weight", qkvz[1:], "w")


def test_key_heads_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(4\).*tensor-parallel-size 3"):
        gated_deltanet_shard(SPEC, 3, 0)
