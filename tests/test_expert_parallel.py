"""Expert parallelism (``--enable-expert-parallel``): under tensor parallelism of size N each
rank holds whole experts, a contiguous range of about E/N of them (vLLM's placement), reads
only their checkpoint tensors, and its partial sums add up to the one-device output.

The layer and loading tests simulate a rank in this process (``parallel_state._GROUP``); the
engine tests start real ranks (two per engine) and compare greedy tokens with one rank and
with HF transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from fixtures_models import write_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy

from chassis import LLM, SamplingParams
from chassis.core import parallel_state
from chassis.core.layers.moe import (
    FusedMoE,
    fused_experts_grouped,
    fused_experts_ref,
    localize_expert_ids,
    select_experts,
)
from chassis.core.parallel_state import TensorParallelGroup, expert_split

# -- placement ---------------------------------------------------------------------------------


def test_experts_are_placed_in_contiguous_ranges_as_vllm_does() -> None:
    assert [expert_split(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    # uneven: the first E % N ranks take one more
    assert [expert_split(7, 2, r) for r in range(2)] == [(0, 4), (4, 3)]
    assert [expert_split(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    # fewer experts than ranks: the last ranks hold none
    assert [expert_split(3, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 0)]
    with pytest.raises(ValueError, match="no expert split"):
        expert_split(8, 2, 2)


@contextmanager
def simulated_rank(rank: int, size: int, expert_parallel: bool = True) -> Iterator[None]:
    """Build layers as rank ``rank`` of ``size`` would (no collective runs here)."""
    saved = parallel_state._GROUP
    parallel_state._GROUP = TensorParallelGroup(rank, size, expert_parallel and size > 1)
    try:
        yield
    finally:
        parallel_state._GROUP = saved


def test_one_rank_or_no_flag_holds_every_expert() -> None:
    with simulated_rank(0, 1):
        assert not parallel_state.expert_parallel()
        assert parallel_state.shard_experts(8) == (0, 8)
    with simulated_rank(1, 2, expert_parallel=False):
        assert parallel_state.shard_experts(8) == (0, 8)
    with simulated_rank(1, 2):
        assert parallel_state.shard_experts(8) == (4, 4)


# -- the layers: each rank's share, and the sum over ranks ---------------------------------------


def _moe_weights(experts: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = 0.3 * torch.randn(experts, inter, hidden, generator=g)
    up = 0.3 * torch.randn(experts, inter, hidden, generator=g)
    down = 0.3 * torch.randn(experts, hidden, inter, generator=g)
    return gate, up, down


def _fused_moe(num_experts: int, gate, up, down) -> FusedMoE:
    """A FusedMoE of this (simulated) rank, loaded with the experts it holds."""
    hidden, inter = gate.shape[2], gate.shape[1]
    layer = FusedMoE(
        num_experts, 2, hidden, inter, renormalize=True, round_weights_to_model_dtype=False
    )
    for e in range(num_experts):
        if layer.holds_expert(e):
            for name, tensor in (("gate", gate), ("up", up), ("down", down)):
                layer.load_expert_weight(e, name, tensor[e])
    return layer


def test_each_rank_holds_whole_experts_and_the_ranks_sum_to_one_device() -> None:
    experts, hidden, inter = 7, 16, 12  # 7 over 2 ranks: 4 and 3
    gate, up, down = _moe_weights(experts, hidden, inter)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, hidden, generator=g)
    logits = torch.randn(11, experts, generator=g)
    expected = _fused_moe(experts, gate, up, down)(x, logits)

    outputs = []
    for rank, (first, count) in enumerate([(0, 4), (4, 3)]):
        with simulated_rank(rank, 2):
            layer = _fused_moe(experts, gate, up, down)
        assert (layer.expert_start, layer.num_local_experts) == (first, count)
        # whole experts: the full intermediate size, only this rank's experts
        assert tuple(layer.w13.shape) == (count, 2 * inter, hidden)
        assert tuple(layer.w2.shape) == (count, hidden, inter)
        assert torch.equal(layer.w13[0], torch.cat([gate[first], up[first]]))
        assert layer.shards_needed() == {
            f"{e}.{p}" for e in range(first, first + count) for p in ("gate", "up", "down")
        }
        with pytest.raises(ValueError, match="is not on this rank"):
            layer.load_expert_weight((first + count) % experts, "gate", gate[0])
        outputs.append(layer(x, logits))
    torch.testing.assert_close(outputs[0] + outputs[1], expected, atol=1e-6, rtol=1e-6)


def test_expert_parallel_ignores_an_intermediate_size_that_tp_cannot_split() -> None:
    """Whole experts: ``moe_intermediate_size`` need not divide by the ranks any more."""
    with simulated_rank(0, 2, expert_parallel=False), pytest.raises(ValueError, match="divisible"):
        FusedMoE(4, 2, 8, 5, renormalize=True, round_weights_to_model_dtype=False)
    with simulated_rank(0, 2):
        layer = FusedMoE(4, 2, 8, 5, renormalize=True, round_weights_to_model_dtype=False)
    assert tuple(layer.w2.shape) == (2, 8, 5)


def test_pairs_of_other_ranks_experts_are_left_out_by_every_torch_path() -> None:
    experts, hidden, inter = 6, 16, 8
    gate, up, down = _moe_weights(experts, hidden, inter, seed=2)
    w13, w2 = torch.cat([gate, up], dim=1), down
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, hidden, generator=g)
    weights, ids = select_experts(torch.randn(9, experts, generator=g), 3, True)
    full = fused_experts_ref(x, w13, w2, weights, ids)
    for path in (fused_experts_ref, fused_experts_grouped):
        parts = [
            path(x, w13[a : a + n], w2[a : a + n], weights, localize_expert_ids(ids, a, n))
            for a, n in ((0, 2), (2, 2), (4, 2))
        ]
        torch.testing.assert_close(sum(parts), full, atol=1e-6, rtol=1e-6)
    # a rank without experts contributes zeros
    nothing = fused_experts_grouped(x, w13[:0], w2[:0], weights, torch.full_like(ids, -1))
    assert torch.equal(nothing, torch.zeros_like(x))


def test_gpt_oss_experts_keep_their_biases_on_their_rank() -> None:
    from chassis.builtin_plugins.models.gpt_oss import GptOssExperts

    experts, hidden, inter = 5, 16, 8
    g = torch.Generator().manual_seed(4)
    checkpoint = {
        "gate_up_proj": 0.3 * torch.randn(experts, hidden, 2 * inter, generator=g),
        "gate_up_proj_bias": 0.1 * torch.randn(experts, 2 * inter, generator=g),
        "down_proj": 0.3 * torch.randn(experts, inter, hidden, generator=g),
        "down_proj_bias": 0.1 * torch.randn(experts, hidden, generator=g),
    }
    x = torch.randn(7, hidden, generator=g)
    top_logits, ids = torch.topk(torch.randn(7, experts, generator=g), 2, dim=-1)
    weights = torch.softmax(top_logits, dim=-1)

    def build() -> GptOssExperts:
        layer = GptOssExperts(experts, hidden, inter, 1.702, 1.5)
        for name, tensor in checkpoint.items():
            layer.load(name, tensor)
        return layer

    expected = build()(x, weights, ids)
    outputs = []
    for rank, (first, count) in enumerate([(0, 3), (3, 2)]):
        with simulated_rank(rank, 2):
            layer = build()
        assert tuple(layer.w13.shape) == (count, 2 * inter, hidden)
        assert tuple(layer.b13.shape) == (count, 2 * inter)
        # every rank keeps the down biases of its experts (not only rank 0)
        assert torch.equal(layer.b2, checkpoint["down_proj_bias"][first : first + count])
        outputs.append(layer(x, weights, ids))
    torch.testing.assert_close(outputs[0] + outputs[1], expected, atol=1e-6, rtol=1e-6)


def test_the_triton_kernels_leave_out_other_ranks_pairs() -> None:
    """The fused kernels (Triton's interpreter, in a child: TRITON_INTERPRET must be set
    before triton is imported) against the reference, split over ranks."""
    pytest.importorskip("triton")
    from triton_compile_check import interpreter_runs

    if not interpreter_runs("test_triton_moe.py"):  # the same kernels as that file's
        pytest.skip("the installed Triton's interpreter cannot run the fused-MoE kernels")
    script = Path(__file__).with_name("expert_parallel_triton_check.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")


# -- loading: a rank reads only its experts ------------------------------------------------------


def test_a_rank_reads_only_its_experts_tensors(
    tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
    from chassis.core import model_loader
    from chassis.core.config import EngineConfig
    from chassis.core.weights import iterate_checkpoint

    read: list[str] = []

    def recording(model_dir, load_format="auto", progress=None, wanted=None):
        for name, tensor in iterate_checkpoint(model_dir, load_format, progress, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(model_loader, "iterate_checkpoint", recording)
    config = EngineConfig(model=str(tiny_qwen3_moe_dir))
    hf_config = model_loader.load_hf_config(tiny_qwen3_moe_dir)

    def expert_bytes(model) -> int:
        return sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
        )

    whole = model_loader.build_model(
        config, hf_config, tiny_qwen3_moe_dir, TorchPagedAttention, "cpu", torch.float32
    )
    everything = set(read)
    read.clear()
    with simulated_rank(1, 2):  # experts 4..7 of 8
        model = model_loader.build_model(
            config, hf_config, tiny_qwen3_moe_dir, TorchPagedAttention, "cpu", torch.float32
        )
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {4, 5, 6, 7}
    # everything else is read as before (the router, attention, norms, embeddings)
    assert {n for n in everything if ".experts." not in n} <= set(read)
    layer = model.model.layers[0].mlp.experts
    assert (layer.expert_start, layer.num_local_experts) == (4, 4)
    assert tuple(layer.w13.shape) == (4, 2 * 32, hf_config.hidden_size)
    assert expert_bytes(model) * 2 == expert_bytes(whole)
    torch.testing.assert_close(layer.w13[0], whole.model.layers[0].mlp.experts.w13[4])


def test_a_rank_without_experts_loads_and_adds_nothing(tmp_path: Path) -> None:
    """One expert over two ranks: rank 1 holds none, its model still loads completely (the
    empty stacks count as filled) and its experts add zeros."""
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
    from chassis.core import model_loader
    from chassis.core.config import EngineConfig

    model_dir = write_tiny_checkpoint(
        "qwen3_moe", tmp_path / "one_expert", num_experts=1, num_experts_per_tok=1
    )
    hf_config = model_loader.load_hf_config(model_dir)
    with simulated_rank(1, 2):
        model = model_loader.build_model(
            EngineConfig(model=str(model_dir)),
            hf_config,
            model_dir,
            TorchPagedAttention,
            "cpu",
            torch.float32,
        )
    experts = model.model.layers[0].mlp.experts
    assert (experts.expert_start, experts.num_local_experts) == (1, 0)
    x = torch.randn(3, hf_config.hidden_size)
    assert torch.equal(experts(x, torch.randn(3, 1)), torch.zeros_like(x))


def test_mixtral_names_are_matched_after_renaming(tiny_mixtral_dir: Path) -> None:
    """Mixtral's ``block_sparse_moe.experts.<e>.w1`` are experts too; other names, and
    names that match no block (the loader then names them in its error), are read."""
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
    from chassis.core import model_loader
    from chassis.core.config import EngineConfig

    config = EngineConfig(model=str(tiny_mixtral_dir), load_format="dummy")
    hf_config = model_loader.load_hf_config(tiny_mixtral_dir)
    with simulated_rank(1, 2):  # experts 2..3 of 4
        model = model_loader.build_model(
            config, hf_config, tiny_mixtral_dir, TorchPagedAttention, "cpu", torch.float32
        )
    wanted = model.needs_checkpoint_tensor
    assert not wanted("model.layers.0.block_sparse_moe.experts.1.w1.weight")
    assert wanted("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    assert not wanted("model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv")
    assert wanted("model.layers.0.block_sparse_moe.gate.weight")
    assert wanted("model.layers.0.block_sparse_moe.experts.9.w1.weight")  # out of range
    assert wanted("model.layers.7.block_sparse_moe.experts.0.w1.weight")  # no such layer


# -- engines: real ranks -------------------------------------------------------------------------


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _engine(model_dir: Path, tensor_parallel_size: int, **engine) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=True,
        **engine,
    )


def _model(llm: LLM) -> torch.nn.Module:
    """The model of the engine's rank 0 (in this process)."""
    return llm.engine.executor.worker.runner.model


def _check_expert_parallel_engine(model_dir: Path, expected_local: tuple[int, int]) -> None:
    """HF's greedy tokens = one rank's (the flag a no-op there) = two expert-parallel ranks';
    the driver (rank 0, this process) holds the first experts whole."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    one = _engine(model_dir, 1)
    whole = [m for m in _model(one).modules() if hasattr(m, "num_local_experts")]
    assert whole and all(m.num_local_experts == m.num_experts for m in whole)
    assert _greedy(one, PROMPTS, MAX_TOKENS) == expected
    one.shutdown()
    two = _engine(model_dir, 2)
    try:
        layers = [m for m in _model(two).modules() if hasattr(m, "num_local_experts")]
        assert layers and all(
            (m.expert_start, m.num_local_experts) == expected_local for m in layers
        )
        assert _greedy(two, PROMPTS, MAX_TOKENS) == expected
    finally:
        two.shutdown()


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


@needs_two_cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch,experts,local",
    [
        ("qwen3_moe", 7, (0, 4)),  # uneven: 4 and 3
        ("mixtral", 4, (0, 2)),
        ("qwen2_moe", 4, (0, 2)),  # the shared expert stays split by columns
    ],
)
def test_two_expert_parallel_ranks_match_one_rank_and_hf(
    tmp_path: Path, arch: str, experts: int, local: tuple[int, int]
) -> None:
    field = "num_local_experts" if arch == "mixtral" else "num_experts"
    model_dir = write_tiny_checkpoint(arch, tmp_path / arch, seed=5, **{field: experts})
    _check_expert_parallel_engine(model_dir, local)


@needs_two_cores
@pytest.mark.timeout(300)
def test_gpt_oss_over_two_expert_parallel_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_gpt_oss_swiglu import make_hf_read_swiglu_config
    from test_gpt_oss import write_tiny_gpt_oss

    make_hf_read_swiglu_config(monkeypatch)
    _check_expert_parallel_engine(write_tiny_gpt_oss(tmp_path / "gpt_oss", seed=6), (0, 2))


def test_the_cli_flag_sets_the_engine_config() -> None:
    import argparse

    from chassis.serve.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    assert engine_config_from_args(
        parser.parse_args(["--enable-expert-parallel", "-tp", "2"])
    ).enable_expert_parallel
    assert engine_config_from_args(parser.parse_args(["-ep"])).enable_expert_parallel
    assert not engine_config_from_args(parser.parse_args([])).enable_expert_parallel
