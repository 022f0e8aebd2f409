"""Tensor parallelism on the CPU: ``--tensor-parallel-size 2`` runs two ranks (the engine's
process and one worker process) joined over gloo, each with half the attention heads, KV
heads and MLP columns of the tiny models (4 heads, 2 KV heads). The bar is the single-device
one: HF's greedy tokens, and seeded sampling identical to one rank.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import psutil
import pytest
from fixtures_process_start import SLEEPING_RANK, run_at_process_start
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy

from chassis import LLM, SamplingParams
from chassis.core import parallel_state
from chassis.core.tp_watchdog import StepTimeoutError

pytestmark = [
    pytest.mark.timeout(300),
    # the CPU platform gives each rank a core of its own
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]


def tp_workers() -> list[psutil.Process]:
    """This process's tensor-parallel worker processes still alive."""
    return [
        child
        for child in psutil.Process().children(recursive=True)
        if "chassis.core.tp_worker_proc" in " ".join(child.cmdline())
    ]


def small_llm(model_dir, tensor_parallel_size: int, **overrides) -> LLM:
    """An engine on a tiny checkpoint, in float32 with a small KV cache (``overrides``: more
    ``LLM`` arguments)."""
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        tensor_parallel_size=tensor_parallel_size,
        **overrides,
    )


def wait_for_no_workers(timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while tp_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tp_workers()


@pytest.fixture
def tiny_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_hf(tiny_dirs, arch: str) -> None:
    model_dir = tiny_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    # the engine is gone, and with it its ranks and its group: this process is single-device
    gc.collect()
    assert (parallel_state.tp_rank(), parallel_state.tp_size()) == (0, 1)
    wait_for_no_workers()


def test_sampling_on_two_ranks_and_one_engine_at_a_time(tiny_llama_dir) -> None:
    """Three checks on one two-rank engine (each rank start costs seconds): seeded sampling
    equals one rank's; unseeded sampling keeps the ranks in step; so do random numbers the
    caller draws between calls. While it runs, no second engine starts; once it is shut down,
    rank 0's share of the cores is given back and a second one starts."""
    import torch

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    one = small_llm(tiny_llama_dir, 1)
    one_rank = [o.outputs[0].token_ids for o in one.generate(PROMPTS[:3], seeded)]
    one.shutdown()
    threads = torch.get_num_threads()
    llm = small_llm(tiny_llama_dir, 2)

    # seeded sampling matches one rank
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], seeded)] == one_rank

    # The driver checks every step that all ranks sampled the same ids (a RuntimeError if not):
    # random sampling without a seed relies on the ranks' generators staying in step.
    params = SamplingParams(
        temperature=1.0, top_k=50, n=2, max_tokens=16, ignore_eos=True, logprobs=2
    )
    outputs = llm.generate(PROMPTS, params)
    assert all(len(c.token_ids) == 16 and len(c.logprobs) == 16 for o in outputs for c in o.outputs)

    # the caller's random numbers do not desync the ranks
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    torch.rand(3)  # rank 0 shares this process's default generator
    assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(PROMPTS[:2], params))

    # a second engine needs the first shut down
    with pytest.raises(ValueError, match="call its shutdown"):
        small_llm(tiny_llama_dir, 2)
    with pytest.raises(ValueError, match="call its shutdown"):  # a single-device one too
        small_llm(tiny_llama_dir, 1)
    llm.shutdown()
    assert torch.get_num_threads() == threads  # rank 0's share of the cores is given back
    second = small_llm(tiny_llama_dir, 2)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    assert len(second.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 4
    second.shutdown()
    wait_for_no_workers()


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(tmp_path) -> None:
    import fixtures_models

    three_kv_heads = fixtures_models.write_tiny_checkpoint(
        "llama",
        tmp_path / "three_kv_heads",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads \(3\) and --tensor-parallel-size 2 do not fit",
    ):
        small_llm(three_kv_heads, 2)
    assert not tp_workers() and time.monotonic() - started < 10


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path, arch: str) -> None:
    """One KV head over two ranks: each rank holds a copy (and its bias, for Qwen2), the
    one its query heads read; tokens equal HF's."""
    import fixtures_models

    model_dir = fixtures_models.write_tiny_checkpoint(
        arch, tmp_path / arch, seed=4, num_key_value_heads=1
    )
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    wait_for_no_workers()


def test_the_cpu_gives_each_rank_a_core() -> None:
    from chassis.platforms.cpu import CpuPlatform

    cores = len(os.sched_getaffinity(0))
    assert CpuPlatform().tensor_parallel_devices(cores) == [0] * cores
    with pytest.raises(ValueError, match=f"needs a core per rank; this host has {cores}"):
        CpuPlatform().tensor_parallel_devices(cores + 1)


def test_a_worker_that_dies_fails_the_step_not_the_caller_forever(tiny_llama_dir) -> None:
    llm = small_llm(tiny_llama_dir, 2)
    [worker] = tp_workers()
    os.kill(worker.pid, signal.SIGKILL)  # (not reaped here: the executor reads its status)
    # what the engine-core process asks while idle, to report a dead rank before a request
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        while time.monotonic() < deadline:
            llm.engine.check_health()
            time.sleep(0.05)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        llm.generate(PROMPTS[:1], params)
    assert time.monotonic() - started < 60
    llm.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        llm.generate(PROMPTS[:1], params)
    wait_for_no_workers()


def test_chassis_serve_with_two_ranks(tiny_qwen2_dir, tmp_path) -> None:
    from server_process import running_server

    prompt = [1, 2, 3, 4, 5]
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [expected] = llm.generate([prompt], params)
    flags = ["--tensor-parallel-size", "2"]
    with running_server(tiny_qwen2_dir, tmp_path, extra_args=flags) as server:
        names = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert "chassis-tp1" in names  # the engine core's rank-1 worker
        response = server.client().completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert response.choices[0].text == expected.outputs[0].text


def test_a_size_below_one_is_refused() -> None:
    from chassis.core.config import EngineConfig

    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1; got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_requests_finishing_at_different_steps_keep_the_ranks_in_step(tiny_qwen3_dir) -> None:
    # Removing finished requests moves rows in the batch: every rank must move them alike,
    # whatever the hash seed of its process.
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [15, 16, 17, 18]]
    lengths = [2, 2, 2, 10, 10, 10, 3, 7]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths[:6]]
    outputs = {}
    for size in (1, 2):
        llm = small_llm(tiny_qwen3_dir, size)
        outputs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outputs[1] == outputs[2]


FAILING_RANK = """\
import chassis.core.worker as worker_module

_execute = worker_module.Worker.execute_model
calls = []


def execute_model(self, scheduler_output):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("injected failure on this rank")
    return _execute(self, scheduler_output)


worker_module.Worker.execute_model = execute_model
"""


def test_a_rank_that_fails_reports_its_own_error_at_once(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    # Only the worker processes read this sitecustomize (it is found at their start-up).
    run_at_process_start(FAILING_RANK, tmp_path, monkeypatch)
    llm = small_llm(tiny_llama_dir, 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: injected failure"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert time.monotonic() - started < 30
    with pytest.raises(RuntimeError, match="cannot run any more"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.shutdown()
    wait_for_no_workers()


RANK_FAILING_AT_START_UP = """\
import chassis.core.config as config_module


def from_dict(cls, values):
    raise ImportError("injected: cannot import name 'missing' (a module mid-edit)")


config_module.EngineConfig.from_dict = classmethod(from_dict)
"""


@pytest.mark.timeout(120)  # a hang guard: before the start-up barrier this hung for 30 min
def test_a_rank_that_fails_before_joining_the_group_fails_the_engine(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    # Rank 1 fails before it joins the group (as when a module it imports is broken), while
    # rank 0 waits for it: rank 0 must not enter gloo's uninterruptible rendezvous alone.
    run_at_process_start(RANK_FAILING_AT_START_UP, tmp_path, monkeypatch)
    with pytest.raises(RuntimeError, match="rank 1: ImportError: injected") as failed:
        small_llm(tiny_llama_dir, 2)
    assert "rank 1 exited with code 1 during 'init'" in str(failed.value.__cause__)
    wait_for_no_workers()


@pytest.mark.timeout(120)
def test_a_driver_that_fails_before_joining_stops_the_waiting_rank(
    tiny_llama_dir, monkeypatch
) -> None:
    from chassis.core import tp_executor

    join = tp_executor.wait_for_every_rank

    def rank_0_fails(ipc_dir, rank, size, watch, *args):
        if rank == 0:  # (this process is rank 0; rank 1's process runs the real one)
            raise ImportError("injected failure of rank 0 before joining")
        join(ipc_dir, rank, size, watch, *args)

    monkeypatch.setattr(tp_executor, "wait_for_every_rank", rank_0_fails)
    with pytest.raises(ImportError, match="injected failure of rank 0"):
        small_llm(tiny_llama_dir, 2)
    wait_for_no_workers()
    assert parallel_state.tp_size() == 1  # rank 0 left no group behind


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_vocabulary_that_does_not_split_evenly_is_padded(tmp_path, arch: str) -> None:
    """The embedding and the LM head (tied for Qwen2) are split by vocabulary rows; 49,153
    rows over two ranks leave the last rank one padding row, which no logit comes from."""
    import fixtures_models

    model_dir = fixtures_models.write_tiny_checkpoint(
        arch, tmp_path / arch, seed=5, vocab_size=49153
    )
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    wait_for_no_workers()


def test_a_vocabulary_that_disagrees_with_the_config_is_refused_on_every_rank(tmp_path):
    """Padding must not hide a checkpoint one row short of config.json's vocabulary."""
    import json

    import fixtures_models

    model_dir = fixtures_models.write_tiny_checkpoint("llama", tmp_path / "m", vocab_size=49153)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] = 49154
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has 49153 rows, expected the vocabulary's 49154"):
        small_llm(model_dir, 2)
    wait_for_no_workers()


@pytest.mark.parametrize(
    "heads,kv_heads,size",
    [(8, 2, 4), (4, 1, 2), (16, 4, 8), (8, 8, 4), (8, 4, 8), (12, 3, 6), (32, 4, 8), (8, 1, 8)],
)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads, kv_heads, size) -> None:
    """Grouped-query attention reads KV head ``q // (heads / kv_heads)`` for query head q;
    every rank's query heads (an even share) must find theirs among its KV heads, split or
    replicated, without starting any process."""
    for rank in range(size):
        first, count = parallel_state.kv_head_split(kv_heads, size, rank)
        per_rank = heads // size
        for q in range(rank * per_rank, (rank + 1) * per_rank):
            kv = q // (heads // kv_heads)
            assert first <= kv < first + count
            # and at the same place in the rank's own grouping
            assert (q - rank * per_rank) // (per_rank // count) == kv - first
    with pytest.raises(ValueError, match="do not fit"):
        parallel_state.kv_head_split(3, 2, 0)


def has_stack_frames(text: str) -> bool:
    """Whether ``text`` holds a Python stack (faulthandler's or traceback's frames)."""
    return "--- rank" in text or 'File "' in text or ".py" in text


@pytest.mark.timeout(120)  # a hang guard: without the watchdog this waits for gloo (30 min)
def test_a_rank_that_hangs_in_a_step_is_named_with_its_stack(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    run_at_process_start(SLEEPING_RANK, tmp_path, monkeypatch)
    llm = small_llm(tiny_llama_dir, 2, execute_model_timeout_s=2)
    with pytest.raises(StepTimeoutError, match=r"did not complete within 2 s") as failed:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert "rank(s) [0, 1] of 2 have not answered" in str(failed.value)
    assert "rank(s) [1] are not in a collective" in str(failed.value)
    assert not has_stack_frames(str(failed.value))  # those are for the log
    report = failed.value.report
    rank_1 = report.split("--- rank 1 (busy):")[1]
    assert "in sleep_inside_a_step" in rank_1  # its Python stack, from faulthandler
    rank_0 = report.split("--- rank 0 (waiting in a collective):")[1].split("--- rank 1")[0]
    assert "in all_reduce" in rank_0
    with pytest.raises(
        RuntimeError, match=r"cannot run any more \('execute' timed out on rank\(s\) \[1\]\)"
    ):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.shutdown()
    wait_for_no_workers()


@pytest.mark.timeout(120)
def test_a_driver_that_hangs_in_a_step_is_named_and_its_workers_stopped(
    tiny_llama_dir, monkeypatch
) -> None:
    from chassis.core import worker as worker_module

    llm = small_llm(tiny_llama_dir, 2, execute_model_timeout_s=2)
    [rank_1_process] = tp_workers()
    execute = worker_module.Worker.execute_model
    calls = []

    def rank_1_lives() -> bool:
        try:
            return rank_1_process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def driver_sleeps_inside_a_step() -> None:
        # rank 0 (this process) holds the step until the watchdog has killed rank 1, which
        # meanwhile waits for it in the step's first collective
        deadline = time.monotonic() + 60
        while rank_1_lives() and time.monotonic() < deadline:
            time.sleep(0.05)

    def execute_model(self, scheduler_output):
        calls.append(1)
        if len(calls) == 2:
            driver_sleeps_inside_a_step()
        return execute(self, scheduler_output)

    monkeypatch.setattr(worker_module.Worker, "execute_model", execute_model)
    with pytest.raises(StepTimeoutError, match=r"did not complete within 2 s") as failed:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    report = failed.value.report
    assert "rank(s) [0] are not in a collective" in str(failed.value)
    rank_0 = report.split("--- rank 0 (busy):")[1].split("--- rank 1")[0]
    assert "in driver_sleeps_inside_a_step" in rank_0
    rank_1 = report.split("--- rank 1 (waiting in a collective):")[1]
    assert "in all_reduce" in rank_1  # faulthandler's dump of the worker
    llm.shutdown()
    wait_for_no_workers()


@pytest.mark.parametrize("timeout_s", [-1, float("inf"), float("nan")])
def test_an_execute_model_timeout_below_zero_or_not_finite_is_refused(timeout_s) -> None:
    from chassis.core.config import EngineConfig

    # (inf would kill the watchdog's thread: no lock wait takes it; nan would turn it off)
    with pytest.raises(ValueError, match="--execute-model-timeout-s must be a finite number >= 0"):
        EngineConfig(execute_model_timeout_s=timeout_s)


@pytest.mark.timeout(180)
def test_a_server_whose_rank_hangs_answers_with_an_error_and_exits(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    import httpx
    from server_process import start_server

    run_at_process_start(SLEEPING_RANK, tmp_path, monkeypatch)
    flags = ["--tensor-parallel-size", "2", "--execute-model-timeout-s", "2"]
    server = start_server(tiny_llama_dir, tmp_path, extra_args=flags)
    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
        response = httpx.post(
            server.base + "/v1/completions", json=body, headers=server.headers, timeout=120
        )
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_dead", error
        # the client learns which step and ranks, and that the engine is dead; no stacks
        message = error["message"]
        assert message.startswith("the engine is not running"), message
        assert "step 'execute' did not complete within 2 s" in message, message
        assert "rank(s) [1] are not in a collective" in message, message
        assert not has_stack_frames(message), message
        server.proc.wait(timeout=120)
        output = server.output()
        # the operator's log has the report at ERROR, with the hanging rank's stack
        logged = output.split(" ERROR [engine] chassis.core.tp_executor: ")[1]
        assert "\n--- rank 1 (busy):\n" in logged, output
        assert "in sleep_inside_a_step" in logged.split("--- rank 1 (busy):")[1], output
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not [p for p in alive if p.is_running()], [p.cmdline() for p in alive]
    finally:
        if server.proc.poll() is None:
            server.kill()
