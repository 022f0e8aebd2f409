"""Decode-graph capture and replay (core/cuda_graphs.py) on the CPU, with a test double.

No CUDA here, so the graph object comes from a test platform whose "graph" records the
captured callable and, on replay, re-runs it eagerly on the static buffers and writes the
result into the tensor capture returned. That exercises everything of the graph path except
the device graph itself: capture sizes, bucketing, padding, the in-place filling of the
static buffers, the slicing of the static output, and the routing of steps (pure decode ->
replay; mixed, prefill and oversize batches and ``enforce_eager`` -> eager). The device graph
is checked by tests/gpu/test_cuda_graphs_gpu.py.

The double re-runs Python at every replay, which a real graph does not: a backend that reads
the metadata's host copies would be wrong under a real graph yet right under the double. The
reference backend ``torch_paged`` reads them; ``ReplayOnlyTorchPaged`` below declares it
graph-capture safe for this double only (the graph runner keeps the host copies equal to the
static device buffers, so a re-run sees the current step). It is never registered outside
these tests.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import chassis.platforms as platforms_module
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.attention import AttentionBackend, ForwardContext
from chassis.core.config import EngineConfig
from chassis.core.cuda_graphs import (
    DecodeGraphs,
    capture_size_pattern,
    capture_sizes,
    eager_reason,
)
from chassis.platforms import reset_current_platform
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cuda import TorchCudaLikePlatform
from chassis.platforms.rocm import RocmPlatform
from chassis.plugins import hookimpl, register_plugin, set_plugin_manager

REPLAY_BACKEND = "torch_paged_replay_test"


# -- test doubles -----------------------------------------------------------------------------


class EagerReplayGraph:
    """Test double of a device graph: ``replay`` re-runs the captured callable eagerly."""

    def __init__(self, fn: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        self.fn = fn
        self.output = output
        self.num_replays = 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.num_replays += 1


class GraphTestPlatform(CpuPlatform):
    """The CPU platform, claiming graph capture and handing out :class:`EagerReplayGraph`."""

    name = "cpu-graph-test"

    def __init__(self) -> None:
        self.graphs: list[EagerReplayGraph] = []
        self.pools: list[object] = []
        self.warmups = 0

    def supports_graph_capture(self) -> bool:
        return True

    def new_graph_pool(self) -> object:
        pool = object()
        self.pools.append(pool)
        return pool

    def capture_graph(
        self, fn: Callable[[], torch.Tensor], pool: object, num_warmup: int = 2
    ) -> tuple[EagerReplayGraph, torch.Tensor]:
        assert pool in self.pools
        for _ in range(num_warmup):
            fn()
            self.warmups += 1
        graph = EagerReplayGraph(fn, fn())
        self.graphs.append(graph)
        return graph, graph.output


class ReplayOnlyTorchPaged(TorchPagedAttention):
    """``torch_paged`` declared graph-capture safe: true under :class:`EagerReplayGraph` only."""

    graph_capture_safe = True


class _ReplayBackendPlugin:
    @hookimpl
    def chassis_register_attention_backends(self, registry: Any) -> None:
        registry.register(REPLAY_BACKEND, ReplayOnlyTorchPaged)


@pytest.fixture(scope="module")
def graph_platform() -> Iterator[GraphTestPlatform]:
    """The test platform as ``current_platform`` and the replay backend registered."""
    set_plugin_manager(None)
    reset_current_platform()
    platform = GraphTestPlatform()
    platforms_module._current = platform
    register_plugin(_ReplayBackendPlugin(), "cuda-graph-test-backends")
    try:
        yield platform
    finally:
        set_plugin_manager(None)
        reset_current_platform()


# -- capture sizes and their validation -------------------------------------------------------


def test_capture_size_pattern() -> None:
    assert capture_size_pattern(1) == [1]
    assert capture_size_pattern(3) == [1, 2, 3]
    assert capture_size_pattern(8) == [1, 2, 4, 8]
    assert capture_size_pattern(20) == [1, 2, 4, 8, 16, 20]
    assert capture_size_pattern(128) == [1, 2, 4, *range(8, 65, 8), 80, 96, 112, 128]
    full = capture_size_pattern(512)
    assert full[:11] == [1, 2, 4, *range(8, 65, 8)]
    assert full[11:] == list(range(80, 513, 16)) and len(full) == 39


def test_capture_sizes_from_config() -> None:
    assert capture_sizes(EngineConfig()) == capture_size_pattern(128)  # max_num_seqs
    assert capture_sizes(EngineConfig(max_num_seqs=1024)) == capture_size_pattern(512)
    assert capture_sizes(EngineConfig(max_num_seqs=256, max_num_batched_tokens=100)) == (
        capture_size_pattern(100)
    )
    # one value: the pattern up to it, clipped to the largest possible decode batch
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[16])) == [1, 2, 4, 8, 16]
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[1000])) == capture_size_pattern(128)
    # several: exactly those, sorted and unique
    assert capture_sizes(EngineConfig(cuda_graph_sizes=[8, 3, 3, 1])) == [1, 3, 8]


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ([0], "sizes >= 1; got 0.*--enforce-eager.*cudagraph_mode NONE"),
        ([4, -2], "sizes >= 1; got -2"),
        ([1, 2, 200], "--cuda-graph-sizes 200 can never be used.*--max-num-seqs"),
    ],
)
def test_cuda_graph_sizes_validation(sizes: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(cuda_graph_sizes=sizes)


def test_cuda_graph_sizes_flag() -> None:
    from chassis.serve.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    config = engine_config_from_args(parser.parse_args(["--cuda-graph-sizes", "1", "2", "4"]))
    assert config.cuda_graph_sizes == [1, 2, 4]
    assert engine_config_from_args(parser.parse_args([])).cuda_graph_sizes is None
    with pytest.raises(ValueError, match="can never be used"):
        engine_config_from_args(
            parser.parse_args(["--max-num-seqs", "8", "--cuda-graph-sizes", "4", "16"])
        )


# -- capability checks ------------------------------------------------------------------------


def test_capability_comes_from_the_interfaces() -> None:
    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    assert AttentionBackend.graph_capture_safe is False
    assert TorchPagedAttention.graph_capture_safe is False
    assert CpuPagedAttention.graph_capture_safe is False
    assert TritonPagedAttention.graph_capture_safe is True
    # ROCm captures through the same torch.cuda code as CUDA.
    assert RocmPlatform.capture_graph is TorchCudaLikePlatform.capture_graph
    assert RocmPlatform.new_graph_pool is TorchCudaLikePlatform.new_graph_pool

    config = EngineConfig(attention_backend="cpu_paged")
    cpu = CpuPlatform()
    assert "does not support graph capture" in eager_reason(config, cpu, CpuPagedAttention)
    with pytest.raises(NotImplementedError, match="cannot capture graphs"):
        cpu.new_graph_pool()
    with pytest.raises(NotImplementedError, match="cannot capture graphs"):
        cpu.capture_graph(lambda: torch.zeros(1), None)
    capable = GraphTestPlatform()
    assert "not graph-capture safe" in eager_reason(config, capable, CpuPagedAttention)
    assert eager_reason(config, capable, ReplayOnlyTorchPaged) is None
    eager = EngineConfig(enforce_eager=True)
    assert "--enforce-eager" in eager_reason(eager, capable, ReplayOnlyTorchPaged)
    # no capture sizes: no graphs, whatever else is on (torch_compile stays as it is)
    none = EngineConfig(cuda_graph_sizes=[], torch_compile=True)
    assert none.torch_compile and capture_sizes(none) == []
    assert "no capture sizes" in eager_reason(none, capable, ReplayOnlyTorchPaged)


# -- the static buffers, without a model --------------------------------------------------------


class _EchoModel(torch.nn.Module):
    """Hidden state of token t = [input_id, position, slot, seq_len, block 0, num_reqs]."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        md = ctx.attn_metadata
        assert md.max_query_len == 1 and md.max_seq_len == 64
        assert md.num_reqs == md.num_actual_tokens == input_ids.shape[0]
        assert md.query_start_loc.tolist() == list(range(md.num_reqs + 1))
        assert torch.equal(md.seq_lens_cpu, md.seq_lens)  # the host copy is current
        self.calls.append(md.num_reqs)
        cols = [
            input_ids,
            positions,
            md.slot_mapping,
            md.seq_lens.long(),
            md.block_table[:, 0].long(),
            torch.full_like(input_ids, md.num_reqs),
        ]
        return torch.stack(cols, dim=1).float()


def test_static_buffers_are_padded_and_refilled() -> None:
    platform = GraphTestPlatform()
    model = _EchoModel()
    graphs = DecodeGraphs(
        model, [], platform, [1, 2, 4, 8], device=torch.device("cpu"), max_model_len=64,
        max_blocks_per_req=4,
    )  # fmt: skip
    graphs.capture()
    # largest first, 2 warm-ups and one capture each, all into one pool
    assert model.calls == [8, 8, 8, 4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert len(platform.pools) == 1 and platform.warmups == 8
    assert [graphs.size_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 0)] == [
        1, 2, 4, 4, 8, 8, None, None,
    ]  # fmt: skip

    rng = np.random.default_rng(0)
    for n in (5, 2, 3):  # a smaller batch after a larger one sees no stale rows
        ids = rng.integers(0, 1000, n)
        pos = rng.integers(0, 60, n)
        slots = rng.integers(0, 64, n)
        lens = (pos + 1).astype(np.int32)
        table = rng.integers(0, 16, (n, 2)).astype(np.int32)
        with torch.inference_mode():  # as in ModelRunner.execute_model
            out = graphs.run(ids, pos, slots, lens, table)
        size = graphs.size_for(n)
        expected = np.stack([ids, pos, slots, lens, table[:, 0], np.full(n, size)], axis=1)
        assert out.shape == (n, 6)
        np.testing.assert_array_equal(out.numpy(), expected)
        inputs = graphs._inputs
        assert (inputs.slot_mappings[0][n:size] == -1).all()  # padding writes nothing
        assert (inputs.seq_lens[n:size] == 1).all()  # and reads one token
    assert graphs.replays == {8: 1, 2: 1, 4: 1} and graphs.num_replays == 3
    assert [g.num_replays for g in platform.graphs] == [1, 1, 1, 0]  # sizes 8, 4, 2, 1
    with pytest.raises(ValueError, match="no graph for a batch of 9"):
        graphs.run(*(np.zeros(9, dtype=np.int64),) * 3, np.ones(9, np.int32), np.zeros((9, 1)))


def test_small_graphs_compute_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs up to MAX_LOGITS_CAPTURE_SIZE also apply ``logits_fn`` and cast to float32;
    ``last_logits`` holds the last replay's rows, None after a larger graph's replay."""
    from chassis.core import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MAX_LOGITS_CAPTURE_SIZE", 2)
    graphs = DecodeGraphs(
        _EchoModel(), [], GraphTestPlatform(), [1, 2, 4], device=torch.device("cpu"),
        max_model_len=64, max_blocks_per_req=2, logits_fn=lambda h: (2 * h).to(torch.float16),
    )  # fmt: skip
    graphs.capture()
    assert graphs.last_logits is None
    for n, has_logits in ((2, True), (3, False), (1, True)):
        ids = np.arange(n) + 10 * n
        with torch.inference_mode():
            out = graphs.run(ids, ids, ids, np.ones(n, np.int32), np.zeros((n, 1), np.int32))
        logits = graphs.last_logits
        if has_logits:
            assert logits is not None and logits.dtype == torch.float32
            torch.testing.assert_close(logits, 2 * out)
        else:
            assert logits is None


def test_input_staging_waits_only_for_an_unfinished_copy() -> None:
    """The two host mirrors alternate; refilling one asks its last copy's event, and waits
    only when the event says the copy is unfinished (or cannot tell)."""
    from chassis.core.cuda_graphs import _HostStaging, _PackedLayout

    class Event:
        def __init__(self, done: bool | None) -> None:
            self.done, self.waits = done, 0

        def query(self) -> bool:
            assert self.done is not None
            return self.done

        def synchronize(self) -> None:
            self.waits += 1

    class NoQueryEvent(Event):
        query = None  # type: ignore[assignment]

    events = [Event(True), Event(False), NoQueryEvent(None), Event(True), Event(True)]
    platform = GraphTestPlatform()
    platform.record_event = lambda: events.pop(0)  # type: ignore[method-assign]
    staging = _HostStaging(_PackedLayout(4, 2, 1), platform, pin_memory=False)
    staging.pin_memory = True  # (pinned buffers need a GPU; only the events matter here)
    finished, unfinished, unknown = events[:3]
    turns = []
    for _ in range(5):
        _, arrays = staging.next()
        assert (arrays[2] == -1).all() and (arrays[3] == 1).all()  # padding as initialized
        turns.append(staging.turn)
        staging.copied()
    assert turns == [1, 0, 1, 0, 1]
    assert (finished.waits, unfinished.waits, unknown.waits) == (0, 1, 1)


# -- the whole engine: graphs vs eager --------------------------------------------------------

MAX_TOKENS = 6


def _prompts(n: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randrange(2, 14))]}
        for _ in range(n)
    ]


def _greedy(llm: Any, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    from chassis import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _llm(model_dir: Any, **engine: Any) -> Any:
    from chassis import LLM

    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        attention_backend=REPLAY_BACKEND,
        **engine,
    )


def _runner(llm: Any) -> Any:
    return llm.engine.executor.worker.runner


@pytest.fixture(scope="module")
def engines(graph_platform: GraphTestPlatform, tiny_llama_dir: Any) -> dict[str, Any]:
    return {
        "graphs": _llm(tiny_llama_dir, cuda_graph_sizes=[1, 2, 4, 8]),
        "eager": _llm(tiny_llama_dir, enforce_eager=True),
    }


def _record_steps(monkeypatch: pytest.MonkeyPatch, runner: Any) -> list[tuple[bool, int, bool]]:
    """Per step: (pure decode?, requests, replayed a graph?)."""
    steps: list[tuple[bool, int, bool]] = []
    execute, run = runner.execute_model_async, runner.graphs.run
    replayed: list[int] = []

    def spy_run(*args: Any) -> torch.Tensor:
        replayed.append(len(args[0]))
        return run(*args)

    def spy_execute(out: Any) -> Any:
        before = len(replayed)
        result = execute(out)
        if not out.is_empty:
            counts = list(out.num_scheduled_tokens.values())
            steps.append((set(counts) == {1}, len(counts), len(replayed) > before))
        return result

    monkeypatch.setattr(runner.graphs, "run", spy_run)
    monkeypatch.setattr(runner, "execute_model_async", spy_execute)
    return steps


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_graph_tokens_equal_eager(
    engines: dict[str, Any], num_prompts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(engines["graphs"])
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    assert _runner(engines["eager"]).graphs is None
    runner.graphs.replays.clear()
    steps = _record_steps(monkeypatch, runner)
    prompts = _prompts(num_prompts, seed=num_prompts)
    assert _greedy(engines["graphs"], prompts) == _greedy(engines["eager"], prompts)
    bucket = {1: 1, 3: 4, 5: 8}[num_prompts]
    # one prefill step, then every decode step replays the graph of the bucket
    assert steps[0][:2] == (False, num_prompts) and not steps[0][2]
    assert steps[1:] == [(True, num_prompts, True)] * (MAX_TOKENS - 1)
    assert runner.graphs.replays == {bucket: MAX_TOKENS - 1}


def test_graph_replay_with_async_scheduling_reads_device_ids(
    engines: dict[str, Any], tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under async scheduling a decode step's input ids are the previous step's samples on
    the device; the graph copies them into its static buffer. Tokens equal the eager run's."""
    llm = _llm(tiny_llama_dir, cuda_graph_sizes=[1, 2, 4, 8], async_scheduling=True)
    runner = _runner(llm)
    steps = _record_steps(monkeypatch, runner)
    input_kinds: list[type] = []
    run = runner.graphs.run

    def spy_input_kind(input_ids: Any, *args: Any) -> torch.Tensor:
        input_kinds.append(type(input_ids))
        return run(input_ids, *args)

    monkeypatch.setattr(runner.graphs, "run", spy_input_kind)
    prompts = _prompts(3, seed=3)
    assert _greedy(llm, prompts) == _greedy(engines["eager"], prompts)
    assert steps[1:] == [(True, 3, True)] * (MAX_TOKENS - 1)
    assert input_kinds == [torch.Tensor] * (MAX_TOKENS - 1)


def test_graphs_of_the_compiled_forward_equal_eager(
    engines: dict[str, Any], tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--torch-compile`` with graphs: capture and replay call the compiled forward (whose
    attention op finds the step's context in the slot the forward fills); tokens equal the
    eager run's and every decode step replays."""
    from chassis.core.compiled_model import CompiledForward

    llm = _llm(tiny_llama_dir, cuda_graph_sizes=[1, 2, 4], torch_compile=True)
    runner = _runner(llm)
    assert isinstance(runner.forward, CompiledForward) and runner.graphs is not None
    steps = _record_steps(monkeypatch, runner)
    prompts = _prompts(3, seed=5)
    assert _greedy(llm, prompts) == _greedy(engines["eager"], prompts)
    assert steps[1:] == [(True, 3, True)] * (MAX_TOKENS - 1)


def test_no_capture_sizes_compile_and_capture_nothing(
    graph_platform: GraphTestPlatform,
    engines: dict[str, Any],
    tiny_llama_dir: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``cudagraph_mode`` NONE with compilation on (``cuda_graph_sizes=[]``, through
    ``LLM(compilation_config=...)``): the forward is compiled, no graph is captured on a
    platform that could, every step runs the compiled forward, tokens equal eager's."""
    from chassis.core.compiled_model import CompiledForward

    captured = len(graph_platform.graphs)
    llm = _llm(tiny_llama_dir, compilation_config={"mode": 3, "cudagraph_mode": "NONE"})
    assert llm.config.torch_compile is True and llm.config.cuda_graph_sizes == []
    runner = _runner(llm)
    assert isinstance(runner.forward, CompiledForward) and runner.graphs is None
    assert len(graph_platform.graphs) == captured  # nothing captured by this engine
    calls: list[int] = []
    forward = runner.forward.__call__

    def spy(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(input_ids.shape[0])
        return forward(input_ids, *args)

    monkeypatch.setattr(runner, "forward", spy)
    prompts = _prompts(3, seed=11)
    assert _greedy(llm, prompts) == _greedy(engines["eager"], prompts)
    assert len(calls) == MAX_TOKENS  # one prefill step, then every decode step


def test_mixed_and_oversize_batches_run_eager(
    graph_platform: GraphTestPlatform, tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 12-token budget splits the prompts into chunks that share steps with decodes; graphs
    # exist only up to 2 requests, so 3 and more decoding together run eager.
    llm = _llm(tiny_llama_dir, cuda_graph_sizes=[1, 2], max_num_batched_tokens=12)
    runner = _runner(llm)
    steps = _record_steps(monkeypatch, runner)
    prompts = _prompts(4, seed=7)
    reference = _llm(tiny_llama_dir, enforce_eager=True, max_num_batched_tokens=12)
    assert _greedy(llm, prompts) == _greedy(reference, prompts)
    for is_decode, num_reqs, replayed in steps:
        assert replayed == (is_decode and num_reqs <= 2), steps
    kinds = {(d, n <= 2) for d, n, _ in steps}
    assert (False, True) in kinds or (False, False) in kinds  # mixed/prefill steps ran
    assert (True, False) in kinds and (True, True) in kinds  # oversize and graph decodes ran


def test_cpu_platform_never_captures(tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the CPU platform must not be asked to capture")

    from chassis import LLM

    monkeypatch.setattr(platforms_module, "_current", CpuPlatform())
    monkeypatch.setattr(CpuPlatform, "new_graph_pool", refuse)
    monkeypatch.setattr(CpuPlatform, "capture_graph", refuse)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=32)
    runner = _runner(llm)
    assert llm.config.attention_backend == "cpu_paged"
    assert runner.platform.name == "cpu" and runner.graphs is None
    assert len(_greedy(llm, _prompts(2, seed=1))[1]) == MAX_TOKENS


# -- EAGLE-3: the target's kept hidden states come out of the graphs ----------------------------


def _record_drafts(drafter: Any) -> list[tuple[list[int], list[int]]]:
    """Wrap ``drafter.propose``: each proposal as (the request's tokens, its drafts)."""
    propose = drafter.propose
    seen: list[tuple[list[int], list[int]]] = []

    def recording(batch: Any, rows: Any, *args: Any) -> Any:
        proposals = propose(batch, rows, *args)
        for request_id, drafts in proposals.items():
            r = batch.row_of[request_id]
            newest = int(batch.num_computed_tokens[r])
            seen.append((batch.token_ids[r, : newest + 1].tolist(), list(drafts)))
        return proposals

    drafter.propose = recording
    return seen


def test_eagle3_decode_graphs_keep_the_heads_hidden_states(
    graph_platform: GraphTestPlatform, tmp_path: Any
) -> None:
    """An EAGLE-3 target captures decode graphs (its kept states are static outputs). While
    ``min_tokens`` blocks drafts the steps are pure decodes that replay; the head then runs over
    the states the graphs wrote, so every later proposal equals the eager engine's, and the
    greedy output is plain decoding's."""
    from fixtures_eagle3 import write_eagle3_head
    from fixtures_models import write_tiny_checkpoint

    from chassis import SamplingParams

    target = write_tiny_checkpoint("llama", tmp_path / "target", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head", layer_ids=[0, 2, 3])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, ignore_eos=True)
    prompts = _prompts(3, seed=11)

    def run(**engine: Any) -> tuple[Any, list[list[int]], list[tuple[list[int], list[int]]]]:
        llm = _llm(target, **engine)
        runner = _runner(llm)
        seen = _record_drafts(runner.drafter) if runner.drafter is not None else []
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return runner, out, seen

    graphs, graph_tokens, graph_drafts = run(cuda_graph_sizes=[1, 2, 4], speculative_config=spec)
    assert graphs.graphs is not None and graphs.graphs.aux_model is graphs.model
    assert [b.shape[0] for b in graphs.graphs.aux_outputs] == [4, 4, 4]
    assert graphs.graphs.replays[4] >= 5  # the min_tokens steps: 3 requests, bucket 4
    _, eager_tokens, eager_drafts = run(enforce_eager=True, speculative_config=spec)
    _, plain_tokens, _ = run(cuda_graph_sizes=[1, 2, 4])
    assert graph_tokens == eager_tokens == plain_tokens
    assert len(graph_drafts) > 6 and graph_drafts == eager_drafts
