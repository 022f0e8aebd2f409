"""Tensor parallelism for the Mamba2 mixer models: two real CPU ranks (gloo) give HF
transformers' greedy tokens (which one rank gives too: ``test_mamba2_models``).

Covered: ``Mamba2ForCausalLM`` with ``n_groups`` 1 (the group replicated on both ranks, its
gated RMSNorm summed over them); with ``n_groups`` 2 (one group per rank) Granite 4.0-H MoE
(RoPE attention, experts) and Nemotron-H (NoPE attention, ReLU² MLP blocks); with ``n_groups`` 1 Granite 4.0-H dense (NoPE attention, the
shared MLP) and Falcon-H1 (the norm before the gate, every multiplier, ``out_proj``'s bias);
Falcon Mamba and Jamba (Mamba-1 mixers: channels split, ``x_proj``'s outputs summed before
their norms); Qwen3-Next (Gated DeltaNet: one group of key and value heads per rank; gated
attention with its one KV head replicated, experts and a shared expert).
The checkpoint cuts are checked directly (the ranks' parts put together are the whole tensor), and
a mixer whose heads or groups do not split is refused before any rank starts.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import save_tiny_checkpoint
from test_falcon_h1 import tiny_config as falcon_h1_config
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_mamba1_models import save_checkpoint as save_mamba1_checkpoint
from test_mamba1_models import tiny_config as mamba1_config
from test_mamba2_models import tiny_config
from test_qwen3_next import tiny_config as qwen3_next_config
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.models.mamba2 import mamba2_spec
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.llm import LLM

#: name -> (tiny_config arch, overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2_group_replicated": ("mamba2", {"n_groups": 1}),
    "granite_dense_group_replicated": ("granite_dense_nope", {"mamba_n_groups": 1}),
    "granite_moe_groups_split": ("granite_moe_rope", {}),
    "nemotron_h_groups_split": ("nemotron_h", {}),
    # the norm before the gate over a replicated group, biases on in_proj and out_proj
    "falcon_h1_group_replicated": (
        "falcon_h1",
        {"mamba_norm_before_gate": True, "mamba_proj_bias": True, "projectors_bias": True},
    ),
    # Mamba-1: channels split, x_proj's dt/B/C summed before their norms
    "falcon_mamba": ("falcon_mamba", {}),
    # Mamba-1 mixers beside attention and experts
    "jamba": ("jamba", {}),
    # Gated DeltaNet beside gated attention, experts and a shared expert
    "qwen3_next": ("qwen3_next", {}),
}


def make_config(arch: str, overrides: dict[str, Any]) -> Any:
    if arch == "falcon_h1":
        return falcon_h1_config("released", **overrides)  # mamba_n_groups 1
    if arch == "qwen3_next":
        return qwen3_next_config(**overrides)  # 2 key heads, 4 value heads
    return tiny_config(arch, **overrides)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, (arch, overrides) in MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        if arch in ("falcon_mamba", "jamba"):  # (A_log perturbed per channel)
            dirs[name] = save_mamba1_checkpoint(mamba1_config(arch, **overrides), directory)
        else:
            dirs[name] = save_tiny_checkpoint(make_config(arch, overrides), directory, seed=7)
    return dirs


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_transformers(model_dirs: dict[str, Path], name: str) -> None:
    model_dir = model_dirs[name]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    got = chassis_greedy(
        model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, max_num_batched_tokens=16
    )
    assert got == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_checkpoint_parts_cover_the_whole_tensor(n_groups: int) -> None:
    """Rank parts of ``in_proj`` (z, x, B, C, dt) and ``conv1d`` (x, B, C): every part's
    rows of each rank, in order; the heads' tensors split, ``out_proj`` by columns with its
    bias on rank 0 only."""
    spec = mamba2_spec(tiny_config("mamba2", n_groups=n_groups))
    size, inter, heads = 2, spec.intermediate_size, spec.num_heads
    width = n_groups * spec.d_state
    in_proj = torch.arange(2 * inter + 2 * width + heads, dtype=torch.float32)[:, None]
    conv = torch.arange(inter + 2 * width, dtype=torch.float32)[:, None, None]
    parts = [mamba2_shard(spec, size, rank) for rank in range(size)]
    rows = [shard.checkpoint_part("in_proj.weight", in_proj, "w")[:, 0] for shard in parts]
    local = parts[0].local
    assert local.num_heads == heads // 2 and local.intermediate_size == inter // 2
    assert local.n_groups == max(n_groups // size, 1)
    half, g = inter // 2, local.n_groups * spec.d_state
    for rank, got in enumerate(rows):
        first_group = parts[rank].first_group * spec.d_state
        expected = torch.cat(
            [
                torch.arange(rank * half, (rank + 1) * half),  # z
                inter + torch.arange(rank * half, (rank + 1) * half),  # x
                2 * inter + first_group + torch.arange(g),  # B
                2 * inter + width + first_group + torch.arange(g),  # C
                2 * inter + 2 * width + torch.arange(rank * 4, rank * 4 + 4),  # dt
            ]
        ).float()
        assert torch.equal(got, expected)
        conv_rows = parts[rank].checkpoint_part("conv1d.weight", conv, "c")[:, 0, 0]
        assert torch.equal(conv_rows, expected[half : half + half + 2 * g] - inter)
    assert parts[1].ranks_per_group == (2 // n_groups if n_groups < 2 else 1)
    out = torch.arange(6 * inter, dtype=torch.float32).reshape(6, inter)
    assert torch.equal(
        torch.cat([s.checkpoint_part("out_proj.weight", out, "o") for s in parts], 1), out
    )
    bias = torch.ones(6)
    assert [s.checkpoint_part("out_proj.bias", bias, "b").sum().item() for s in parts] == [6, 0]
    a_log = torch.arange(heads, dtype=torch.float32)
    assert torch.equal(torch.cat([s.checkpoint_part("A_log", a_log, "a") for s in parts]), a_log)
    with pytest.raises(ValueError, match="rows, expected"):
        parts[0].checkpoint_part("in_proj.weight", in_proj[1:], "w")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_heads": 3, "head_dim": 64, "expand": 3, "n_groups": 1}, r"heads \(3\)"),
        ({"num_heads": 6, "head_dim": 32, "expand": 3, "n_groups": 3}, r"n_groups \(3\)"),
    ],
    ids=["heads", "groups"],
)
def test_a_mixer_that_does_not_split_is_refused(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    """Refused with a ValueError naming the count, before any rank starts."""
    model_dir = save_tiny_checkpoint(tiny_config("mamba2", **overrides), tmp_path, seed=7)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), dtype="float32", max_model_len=256, tensor_parallel_size=2)
    wait_for_no_workers()


def test_deltanet_key_heads_that_do_not_split_are_refused(tmp_path: Path) -> None:
    """Qwen3-Next with one Gated DeltaNet key head: a ValueError naming it, before any rank
    starts."""
    config = qwen3_next_config(linear_num_key_heads=1, linear_num_value_heads=2)
    model_dir = save_tiny_checkpoint(config, tmp_path, seed=7)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(1\)"):
        LLM(str(model_dir), dtype="float32", max_model_len=256, tensor_parallel_size=2)
    wait_for_no_workers()
