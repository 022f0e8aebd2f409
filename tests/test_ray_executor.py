"""``--distributed-executor-backend ray``: two ranks in Ray actors on the CPU (gloo), on a
Ray instance of two CPUs this module starts (and stops). The bar is the single-rank engine's
and HF's greedy tokens; a rank whose actor dies mid-generation is an error, never a hang.
Skipped without Ray (``pip install 'chassis-llm[ray]'``); the error tests run without it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
import torch
from fixtures_process_start import SLEEPING_RANK
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy

from chassis import LLM, SamplingParams
from chassis.core.config import EngineConfig

pytestmark = pytest.mark.timeout(300)

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="each rank takes a core"
)


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray instance of two CPUs for this module; the executors find it connected."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def shut_down_every_llm(monkeypatch):
    """Every ``LLM`` a test makes (its own, or one a bench function makes) is shut down when
    the test ends, passed or failed: a failed test's engine would otherwise keep its actors
    and the cluster's 2 CPU bundles, and the next test would wait in its placement until the
    run's timeout ended the whole run."""
    made: list[LLM] = []
    init = LLM.__init__

    def recording_init(self, *args, **kwargs) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    yield
    for llm in made:
        if getattr(llm, "_shut_down", True) is False:
            llm.shutdown()
        elif "engine" in vars(llm) and not hasattr(llm, "_shut_down"):
            llm.engine.shutdown()  # its __init__ failed after the engine started


def ray_llm(model_dir, tensor_parallel_size: int = 2) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="ray",
    )


def greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def actor_pids(llm: LLM) -> list[int]:
    ray = sys.modules["ray"]
    return ray.get([actor.pid.remote() for actor in llm.engine.executor.actors])


def wait_for_exit(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)]


@needs_two_cores
def test_two_ray_ranks_match_one_rank_and_hf_and_report_a_dead_rank(
    ray_cluster, tiny_llama_dir
) -> None:
    expected = hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    one = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    assert greedy(one, PROMPTS, MAX_TOKENS) == expected
    one.shutdown()
    llm = ray_llm(tiny_llama_dir)
    pids = actor_pids(llm)
    assert len(pids) == 2 and os.getpid() not in pids  # every rank is an actor
    # what `chassis bench` asks the executor: the actors' dtype, and no device here
    assert llm.engine.executor.model_dtype() == torch.float32
    assert llm.engine.executor.local_device() is None
    assert greedy(llm, PROMPTS, MAX_TOKENS) == expected
    llm.engine.check_health()  # idle, both ranks alive
    # an actor that dies while the engine is idle is reported before the next request
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError, match=r"rank 1 exited .* during 'idle'"):
        while time.monotonic() < deadline:
            llm.engine.check_health()
            time.sleep(0.05)
    llm.shutdown()
    wait_for_exit(pids)  # the actors are killed, the bundles given back
    assert ray_cluster.available_resources().get("CPU") == 2.0


@needs_two_cores
def test_an_actor_killed_mid_generation_fails_the_call(ray_cluster, tiny_llama_dir) -> None:
    llm = ray_llm(tiny_llama_dir)
    pids = actor_pids(llm)
    executor = llm.engine.executor
    execute, steps = executor.execute_model, []

    def execute_then_kill(scheduler_output):
        steps.append(1)
        if len(steps) == 3:  # mid-generation: rank 1's process dies before this step
            os.kill(pids[1], signal.SIGKILL)
        return execute(scheduler_output)

    executor.execute_model = execute_then_kill
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(its Ray actor died"):
        llm.generate(PROMPTS[:2], params)
    assert time.monotonic() - started < 60
    with pytest.raises(RuntimeError, match="cannot run any more"):
        llm.generate(PROMPTS[:1], params)
    llm.engine.check_health()  # broken already: reported above, nothing more to find
    llm.shutdown()
    wait_for_exit(pids)


@needs_two_cores
def test_throughput_bench_runs_on_ray_ranks(ray_cluster, tiny_llama_dir, capsys) -> None:
    from chassis.serve.args import engine_config_from_args
    from chassis.serve.bench_offline import throughput
    from chassis.serve.cli import build_parser

    argv = ["bench", "throughput", str(tiny_llama_dir), "--dtype", "float32"]
    argv += ["--max-model-len", "128", "--num-kv-blocks", "64", "--tensor-parallel-size", "2"]
    argv += ["--distributed-executor-backend", "ray", "--num-prompts", "2"]
    argv += ["--input-len", "4", "--output-len", "4"]
    args = build_parser().parse_args(argv)
    report = throughput(args, engine_config_from_args(args))
    assert report["dtype"] == "float32"
    assert [r["backend"] for r in report["results"]] == ["chassis"]
    assert report["results"][0]["output_tokens"] == 2 * 4


def test_the_flag_reaches_the_config() -> None:
    import argparse

    from chassis.serve.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    for backend in ("mp", "uni"):
        args = parser.parse_args(["m", "--distributed-executor-backend", backend])
        assert engine_config_from_args(args).distributed_executor_backend == backend
    assert engine_config_from_args(parser.parse_args(["m"])).distributed_executor_backend == "mp"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["m", "--distributed-executor-backend", "spark"])


def test_unknown_and_contradictory_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="must be mp, ray or uni; got 'spark'"):
        EngineConfig(distributed_executor_backend="spark")
    with pytest.raises(ValueError, match="uni runs one rank; use mp or ray"):
        EngineConfig(distributed_executor_backend="uni", tensor_parallel_size=2)
    assert EngineConfig(distributed_executor_backend=None, tensor_parallel_size=2)  # vLLM's auto


def test_ray_without_ray_installed_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray finds
    with pytest.raises(ValueError, match=r"pip install 'chassis-llm\[ray\]'"):
        EngineConfig(distributed_executor_backend="ray", tensor_parallel_size=2)
    from chassis.core.ray_executor import import_ray

    with pytest.raises(ValueError, match=r"pip install 'chassis-llm\[ray\]'"):
        import_ray()


def test_a_cluster_without_the_resources_is_refused_at_once(ray_cluster, tiny_llama_dir) -> None:
    # (4 ranks: the tiny model's 4 heads and 2 KV heads split; the module's Ray has 2 CPUs)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"needs 4 CPU .*; the Ray cluster has 2"):
        ray_llm(tiny_llama_dir, tensor_parallel_size=4)
    assert time.monotonic() - started < 30
    assert ray_cluster.available_resources().get("CPU") == 2.0


@needs_two_cores
def test_lora_adapters_on_ray_ranks(ray_cluster, tiny_llama_dir, tmp_path) -> None:
    """Each rank applies its share of the adapter: the one-rank engine's tokens. Adapters are
    pinned on every rank or none; one that cannot be read is refused and the group serves on."""
    from fixtures_lora import write_peft_adapter

    from chassis.core.lora import LoRARequest

    adapter = LoRARequest("a", 1, str(write_peft_adapter(tmp_path / "a", tiny_llama_dir, seed=1)))
    settings = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    one = LLM(str(tiny_llama_dir), **settings)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, lora_request=adapter)]
    base = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    assert expected != base
    one.shutdown()
    llm = LLM(
        str(tiny_llama_dir), **settings, tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        assert llm.engine.info.lora_target_shapes["model.layers.0.mlp.down_proj"] == (128, 64)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=adapter)]
        assert got == expected
        with pytest.raises(ValueError):
            llm.engine.executor.pin_lora(LoRARequest("gone", 2, str(tmp_path / "missing")))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
    finally:
        llm.shutdown()


@needs_two_cores
def test_a_ranks_start_up_error_is_a_value_error(ray_cluster, tmp_path) -> None:
    """A checkpoint one vocabulary row short of config.json fails every rank's load: the
    ranks' ValueError, after every actor is stopped."""
    import json

    import fixtures_models

    model_dir = fixtures_models.write_tiny_checkpoint("llama", tmp_path / "m", vocab_size=49153)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] = 49154
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor-parallel rank \d: ValueError: .*49153 rows"):
        ray_llm(model_dir)
    deadline = time.monotonic() + 15
    while ray_cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU") == 2.0  # the bundles are given back


# SLEEPING_RANK (fixtures_process_start.py) is run first by the actors' processes too
# (their sitecustomize, through PYTHONPATH).


def actors_run_at_start(source: str, tmp_path, monkeypatch) -> None:
    """Have the actors started after this run ``source`` first, as their ``sitecustomize``
    (the executor forwards its environment's PYTHONPATH to them, as Ray would not)."""
    from chassis.core import ray_executor

    (tmp_path / "sitecustomize.py").write_text(source)
    forwarded = ray_executor._forwarded_env
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    monkeypatch.setattr(ray_executor, "_forwarded_env", lambda: {**forwarded(), "PYTHONPATH": path})


@needs_two_cores
@pytest.mark.timeout(180)  # a hang guard: without the watchdog this waits for gloo (30 min)
def test_a_ray_rank_that_hangs_in_a_step_is_named_with_its_stack_and_killed(
    ray_cluster, tiny_llama_dir, tmp_path, monkeypatch, caplog
) -> None:
    import logging

    from chassis.core.tp_watchdog import StepTimeoutError

    actors_run_at_start(SLEEPING_RANK, tmp_path, monkeypatch)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        execute_model_timeout_s=2,
    )
    pids = actor_pids(llm)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with (
        caplog.at_level(logging.ERROR, logger="chassis.core.ray_executor"),
        pytest.raises(StepTimeoutError, match=r"did not complete within 2 s") as failed,
    ):
        llm.generate(PROMPTS[:1], params)
    assert "rank(s) [0, 1] of 2 have not answered" in str(failed.value)
    assert "rank(s) [1] are not in a collective" in str(failed.value)
    assert 'File "' not in str(failed.value)  # the stacks are for the log
    report = failed.value.report
    assert report in caplog.text  # logged at ERROR
    rank_1 = report.split("--- rank 1 (busy):")[1]
    assert "in sleep_inside_a_step" in rank_1  # its Python stack, from faulthandler
    rank_0 = report.split("--- rank 0 (waiting in a collective):")[1].split("--- rank 1")[0]
    assert "in all_reduce" in rank_0
    wait_for_exit(pids)  # the watchdog killed both actors
    with pytest.raises(
        RuntimeError, match=r"cannot run any more \('execute' timed out on rank\(s\) \[1\]\)"
    ):
        llm.generate(PROMPTS[:1], params)
    llm.shutdown()
    deadline = time.monotonic() + 15
    while ray_cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU") == 2.0  # the bundles are given back


#: what a server's processes run first: the sleeping rank, and their PYTHONPATH forwarded to
#: the actors the engine core starts (so that the actors run this too)
SERVER_SLEEPING_RANK = (
    SLEEPING_RANK
    + """
import os

import chassis.core.ray_executor as ray_executor

_forwarded = ray_executor._forwarded_env
ray_executor._forwarded_env = lambda: {**_forwarded(), "PYTHONPATH": os.environ["PYTHONPATH"]}
"""
)


@needs_two_cores
@pytest.mark.timeout(240)
def test_a_server_whose_ray_rank_hangs_answers_503_and_exits(
    ray_cluster, tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    """The server's engine core joins this module's Ray instance (``address="auto"``)."""
    import httpx
    from server_process import start_server

    (tmp_path / "sitecustomize.py").write_text(SERVER_SLEEPING_RANK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    flags += ["--execute-model-timeout-s", "2", "--dtype", "float32"]
    server = start_server(tiny_llama_dir, tmp_path, extra_args=flags, max_model_len=128)
    try:
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
        assert 'File "' not in message and ".py" not in message, message
        server.proc.wait(timeout=120)
        assert server.proc.returncode == 1
        output = server.output()
        # the operator's log has the report at ERROR, with the hanging rank's stack
        logged = output.split(" ERROR [engine] chassis.core.ray_executor: ")[1]
        assert "\n--- rank 1 (busy):\n" in logged, output
        assert "in sleep_inside_a_step" in logged.split("--- rank 1 (busy):")[1], output
    finally:
        if server.proc.poll() is None:
            server.kill()
    # the actors are gone and their bundles given back
    deadline = time.monotonic() + 15
    while ray_cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU") == 2.0
    while rank_actor_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_actor_processes()


def rank_actor_processes() -> list[psutil.Process]:
    """This machine's processes of rank actors (Ray titles them ``ray::RankActor...``)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "ray::RankActor" in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


@needs_two_cores
def test_a_rank_s_stacks_are_dumped_by_a_task_on_its_node(ray_cluster) -> None:
    """The watchdog's way to a rank on another node (a task pinned to the rank's node, no CPU
    asked), run here on this one node: while the actor's bundle and the other CPU are
    taken, the dump is the actor's threads' stacks, from faulthandler."""
    from chassis.core.ray_executor import RankActor, dump_stacks_on

    actor = ray_cluster.remote(RankActor).options(num_cpus=2).remote(30)
    try:
        _, node, pid, fd = ray_cluster.get(actor.locate.remote())
        dump = ray_cluster.get(dump_stacks_on(ray_cluster, node, pid, fd), timeout=60)
        assert "Thread 0x" in dump and 'File "' in dump, dump  # faulthandler's format
        assert ray_cluster.get(actor.ping.remote())  # the signal did not stop the actor
    finally:
        ray_cluster.kill(actor)
    deadline = time.monotonic() + 15
    while ray_cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU") == 2.0
