"""The memory profile's decode step for models with request states
(:mod:`chassis.core.state_decode_profile`): ``ModelRunner.profile_run`` runs, after its
prefill, one decode step over every free state slot (as many requests as a step holds),
which writes to them for real, and leaves them zeroed; a slot a request holds is untouched.
On a tiny Qwen3-Next checkpoint (Gated DeltaNet and gated attention) whose delta-rule states
(8 value heads of 64 x 64) outweigh a short prefill's activations: the profile's peak then
covers a real decode step of ``max_num_seqs`` requests, which the prefill alone misses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures_models import save_tiny_checkpoint
from fixtures_tensor_memory import PeakTensorBytes
from test_lfm2 import tiny_config as lfm2_config
from test_mamba1_models import save_checkpoint as save_mamba1_checkpoint
from test_mamba1_models import tiny_config as mamba1_config
from test_mamba2_models import tiny_config as mamba2_config
from test_qwen3_next import tiny_config

from chassis.core.llm import LLM
from chassis.core.request_state_cache import RequestStatePool, RequestStateSpec
from chassis.core.sampling_params import SamplingParams
from chassis.core.state_decode_profile import borrowed_state_slots, free_state_slots

NUM_SEQS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_value_heads=8)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("q3n"), seed=5)


@pytest.fixture
def llm(model_dir: Path) -> Iterator[LLM]:
    """A fresh engine: every state slot free (a finished request's slot is only given back
    at the runner's next step)."""
    engine = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=64,
        max_num_seqs=NUM_SEQS,
        max_num_batched_tokens=128,
    )
    yield engine
    engine.shutdown()


def record_state_steps(runner, seen: list[tuple[list[int], bool]]):
    """``runner.forward``, noting each step with state slots: its slots and whether it wrote
    every state tensor of each (one token from zeros: nonzero)."""
    forward = runner.forward
    pool = runner.request_states

    def recording(input_ids, positions, ctx):
        hidden = forward(input_ids, positions, ctx)
        if ctx.state_slots is not None:
            slots = ctx.state_slots.tolist()
            written = all(bool(t[slots].flatten(1).any(1).all()) for t in pool.tensors)
            seen.append((slots, written))
        return hidden

    return recording


def test_the_profile_decodes_over_the_free_slots_and_zeroes_them(llm: LLM) -> None:
    runner = llm.engine.executor.worker.runner
    pool = runner.request_states
    held = pool.allocate("a real request")
    gen = torch.Generator().manual_seed(0)
    for tensor in pool.tensors:
        tensor[held] = torch.randn(tensor.shape[1:], generator=gen)
    kept = [tensor[held].clone() for tensor in pool.tensors]
    forward = runner.forward
    seen: list[tuple[list[int], bool]] = []
    recording = record_state_steps(runner, seen)
    runner.forward = recording
    try:
        runner.profile_run(llm.config.max_num_batched_tokens)
    finally:
        runner.forward = forward
    free = [s for s in range(NUM_SEQS) if s != held]
    assert seen == [(free, True)]  # one decode step over every free slot
    for tensor, before in zip(pool.tensors, kept, strict=True):
        assert not tensor[free].any()
        assert torch.equal(tensor[held], before)
    pool.free("a real request")
    # the engine still runs, a request's slot starting from zeros (as before the profile)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(["hello world"], params)[0].outputs[0].token_ids
    runner.profile_run(llm.config.max_num_batched_tokens)
    assert llm.generate(["hello world"], params)[0].outputs[0].token_ids == first


def test_the_profile_peak_covers_a_full_decode_step(llm: LLM) -> None:
    """Without the decode step, a budget of few tokens (one short prefill) would miss the
    peak of a decode step of ``max_num_seqs`` requests; with it, the profile's peak is at
    least that step's."""
    runner = llm.engine.executor.worker.runner
    with PeakTensorBytes() as with_decode:
        runner.profile_run(NUM_SEQS)
    saved, runner.request_states = runner.request_states, None
    try:
        with PeakTensorBytes() as prefill_only:
            runner.profile_run(NUM_SEQS)
    finally:
        runner.request_states = saved
    # a real decode step of NUM_SEQS requests
    ids = [f"r{i}" for i in range(NUM_SEQS)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    forward = runner.forward
    peaks: list[int] = []

    def measured(input_ids, positions, ctx):
        with PeakTensorBytes() as step:
            hidden = forward(input_ids, positions, ctx)
        if ctx.attn_metadata.num_reqs == NUM_SEQS and input_ids.numel() == NUM_SEQS:
            peaks.append(step.peak)
        return hidden

    runner.forward = measured
    try:
        llm.generate([f"prompt {i}" for i in ids], params)
    finally:
        runner.forward = forward
    assert peaks
    assert prefill_only.peak < max(peaks) <= with_decode.peak


@pytest.mark.parametrize("arch", ["mamba2", "falcon_mamba", "lfm2"])
def test_other_state_mixers_run_the_profile_decode(tmp_path: Path, arch: str) -> None:
    """The Mamba2, Mamba-1 and short-conv mixers run the dummy decode step over every slot
    (writing them) and come out with a zeroed pool."""
    if arch == "falcon_mamba":
        model_dir = save_mamba1_checkpoint(mamba1_config(arch), tmp_path)
    else:
        config = mamba2_config(arch) if arch == "mamba2" else lfm2_config("released")
        model_dir = save_tiny_checkpoint(config, tmp_path, seed=7)
    engine = LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=4)
    try:
        runner = engine.engine.executor.worker.runner
        seen: list[tuple[list[int], bool]] = []
        forward, runner.forward = runner.forward, record_state_steps(runner, seen)
        try:
            runner.profile_run(engine.config.max_num_batched_tokens)
        finally:
            runner.forward = forward
        assert seen == [([0, 1, 2, 3], True)]
        assert not any(t.any() for t in runner.request_states.tensors)
    finally:
        engine.shutdown()


def test_borrowed_slots_are_the_free_ones_and_come_back_zeroed() -> None:
    pool = RequestStatePool([RequestStateSpec("s", (2,), torch.float32)], 4, "cpu")
    held = pool.allocate("r")  # slot 0
    pool.tensors[0].fill_(7.0)
    assert free_state_slots(pool, 2) == [1, 2]
    with borrowed_state_slots(pool, 8, "cpu") as slots:
        assert slots.tolist() == [1, 2, 3]
    assert pool.tensors[0][held].tolist() == [7.0, 7.0]
    assert not pool.tensors[0][1:].any()
    pool.release()
    with borrowed_state_slots(pool, 8, "cpu") as slots:
        assert slots.numel() == 0
