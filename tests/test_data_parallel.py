"""Data parallelism (``--data-parallel-size N``): N engine cores behind one ``AsyncLLM``.

Routing, stats and utility results are checked on fake engine clients (no processes); then
one ``AsyncLLM`` with two real engine cores on the tiny Llama (sleep mode on) serves
concurrent requests (the same tokens as one engine, half on each), aborts, seeded sampling,
structured outputs, utilities, the HTTP server, and, last, an engine's death.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from engines import TINY_ENGINE, tiny_async_llm
from fastapi.testclient import TestClient

from chassis.core.config import EngineConfig
from chassis.core.data_parallel import engine_rank_devices
from chassis.core.dp_client import DataParallelClient
from chassis.core.dp_combine import combine_scheduler_stats, combine_utility_results
from chassis.core.engine_core import EngineInfo
from chassis.core.errors import EngineBusyError, EngineDeadError, EngineSleepingError
from chassis.core.llm import LLM
from chassis.core.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from chassis.core.sampling_params import SamplingParams
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.interface import Platform
from chassis.serve.app import build_app
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser
from chassis.serve.settings import ServerSettings

PROMPTS = [f"Request {i} is about the number {i * 7}" for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
#: long enough to be running while the test looks
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


# -- fake engine clients: routing, stats, utilities, death -------------------------------


class FakeClient:
    """Built like ``EngineCoreClient``; records what the DP client sends; utility calls
    answer at once from ``answers``, an exception there is raised by the call's future."""

    instances: list[FakeClient] = []
    #: the rank whose construction fails (after starting the next engines), if any
    fail_rank: int | None = None

    def __init__(self, config, on_outputs, on_dead, while_starting=None) -> None:
        self.rank = config.data_parallel_rank
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answers: dict[str, Any] = {}
        self.alive = True
        self.info = EngineInfo(
            platform="cpu",
            attention_backend="x",
            scheduler="fcfs",
            sampler="default",
            num_kv_blocks=10 * (self.rank + 1),
            block_size=16,
            max_model_len=64,
        )
        FakeClient.instances.append(self)
        if while_starting is not None:
            while_starting()
        if self.rank == FakeClient.fail_rank:
            raise ValueError(f"engine {self.rank} refuses")

    @property
    def is_alive(self) -> bool:
        return self.alive

    def add_requests(self, requests) -> None:
        self.sent += [r.request_id for r in requests]

    def abort(self, ids) -> None:
        self.aborted += list(ids)

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        self.calls.append((method, args))
        future: Future[Any] = Future()
        answer = self.answers.get(method)
        if isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)
        return future

    def shutdown(self) -> None:
        self.alive = False


def fake_dp(size: int = 2) -> tuple[DataParallelClient, list[EngineCoreOutputs], list[str]]:
    outputs: list[EngineCoreOutputs] = []
    deaths: list[str] = []
    FakeClient.instances = []
    dp = DataParallelClient(
        EngineConfig(data_parallel_size=size),
        outputs.append,
        deaths.append,
        client_class=FakeClient,  # type: ignore[arg-type]
    )
    return dp, outputs, deaths


def requests(*ids: str) -> list[Any]:
    return [SimpleNamespace(request_id=i) for i in ids]


def finished(*ids: str, stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=i, finish_reason=FinishReason.LENGTH) for i in ids],
        stats=stats,
    )


def test_each_prompt_goes_to_the_engine_with_fewest_unfinished_requests() -> None:
    dp, outputs, _ = fake_dp()
    e0, e1 = dp.clients
    assert [c.rank for c in dp.clients] == [0, 1]
    for request_id in "abc":
        dp.add_request(*requests(request_id))
    assert (e0.sent, e1.sent) == (["a", "c"], ["b"])  # ties go to the lowest index
    dp.add_requests(requests("d-0", "d-1"))  # n=2: both completions on one engine
    assert e1.sent == ["b", "d-0", "d-1"] and dp.num_unfinished == [2, 3]
    dp.abort(["a", "unknown"])
    assert e0.aborted == ["a"] and dp.num_unfinished == [1, 3]
    e1.on_outputs(finished("b", "d-0"))  # finished on engine 1
    assert dp.num_unfinished == [1, 1] and len(outputs) == 1
    dp.abort(["b"])  # finished already: nothing to send
    assert e1.aborted == []
    dp.add_request(*requests("e"))
    assert e0.sent[-1] == "e" and dp.num_sent == [3, 3]


def test_stats_are_summed_over_the_engines() -> None:
    dp, outputs, _ = fake_dp()
    e0, e1 = dp.clients  # 10 and 20 KV blocks
    e0.on_outputs(finished(stats=SchedulerStats(num_running=2, kv_cache_usage=0.5)))
    e1.on_outputs(
        finished(
            stats=SchedulerStats(
                num_running=1, num_waiting=3, kv_cache_usage=0.25, prefix_cache_queries=7
            )
        )
    )
    total = outputs[-1].stats
    assert total is not None and (total.num_running, total.num_waiting) == (3, 3)
    assert total.kv_cache_usage == pytest.approx(10 / 30)  # 5 + 5 used blocks of 30
    assert total.prefix_cache_queries == 7
    assert [s.num_running for s in dp.engine_stats] == [2, 1]
    both = combine_scheduler_stats(
        [
            SchedulerStats(spec_num_accepted_tokens_per_pos=[3, 1], running_lora_adapters=["b"]),
            SchedulerStats(spec_num_accepted_tokens_per_pos=[2], running_lora_adapters=["a", "b"]),
        ],
        [0, 0],
    )
    assert both.spec_num_accepted_tokens_per_pos == [5, 1] and both.kv_cache_usage == 0.0
    assert both.running_lora_adapters == ["a", "b"]


def test_utility_results_combine_into_one() -> None:
    assert combine_utility_results("reset_prefix_cache", [True, True]) is True
    assert combine_utility_results("is_sleeping", [False, True]) is True
    assert combine_utility_results("is_paused", [False, False]) is False
    assert combine_utility_results("pause", [True, False]) is False  # one still drains
    assert combine_utility_results("sleep", [["kv_cache"], []]) == []  # one still waits
    assert combine_utility_results("sleep", [["weights"], ["kv_cache"]]) == [
        "kv_cache",
        "weights",
    ]
    assert combine_utility_results("wake_up", [[], ["weights"]]) == ["weights"]
    progress = [[False, ["kv_cache"], None], [True, [], None]]
    assert combine_utility_results("sleep_progress", progress) == [True, [], None]
    progress[1] = [False, [], "OSError: x"]
    assert combine_utility_results("sleep_progress", progress) == [False, [], "OSError: x"]
    dp, _, _ = fake_dp()
    for client in dp.clients:
        client.answers["is_paused"] = client.rank == 1
    assert dp.call_utility("is_paused").result() is True
    assert [c.calls for c in dp.clients] == [[("is_paused", ())]] * 2


def test_a_sleep_one_engine_refuses_wakes_the_others() -> None:
    dp, _, _ = fake_dp()
    e0, e1 = dp.clients
    e0.answers["sleep"] = ["kv_cache", "weights"]
    e1.answers["sleep"] = EngineBusyError("1 unfinished request")
    with pytest.raises(EngineBusyError, match="unfinished"):
        dp.call_utility("sleep", 1, "keep").result()
    assert e0.calls == [("sleep", (1, "keep")), ("wake_up", (None,))]
    assert e1.calls == [("sleep", (1, "keep"))]


def test_one_engine_dying_stops_the_others() -> None:
    dp, _, deaths = fake_dp(3)
    dp.clients[1].on_dead("engine core process died (exit code -9)")
    dp.clients[2].on_dead("engine core process died (exit code 0)")  # reported once only
    assert deaths == ["data-parallel engine 1: engine core process died (exit code -9)"]
    assert dp._stopper is not None
    dp._stopper.join(5)
    assert [c.alive for c in dp.clients] == [False, True, False]
    assert not dp.is_alive


def test_an_engine_that_fails_to_start_stops_the_started_ones() -> None:
    FakeClient.fail_rank = 0  # engine 0 fails once engine 1 (started by it) is ready
    try:
        with pytest.raises(ValueError, match="engine 0 refuses"):
            fake_dp()
    finally:
        FakeClient.fail_rank = None
    assert [(c.rank, c.alive) for c in FakeClient.instances] == [(0, True), (1, False)]


# -- settings and placement ------------------------------------------------------------------


def test_sizes_below_one_and_the_offline_llm_are_refused(tiny_llama_dir) -> None:
    for size in (0, -2):
        with pytest.raises(ValueError, match="--data-parallel-size must be an integer >= 1"):
            EngineConfig(data_parallel_size=size)
        with pytest.raises(ValueError, match="--data-parallel-size must be an integer >= 1"):
            engine_config_from_args(build_parser().parse_args(["serve", "-dp", str(size)]))
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2"])
    assert engine_config_from_args(args).data_parallel_size == 2
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in 0\.\.1"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match=r"not with --distributed-executor-backend ray"):
        EngineConfig(data_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"the offline LLM runs one engine.*AsyncLLM"):
        LLM(str(tiny_llama_dir), data_parallel_size=2)


class FourDevices(CpuPlatform):
    """The default placement (``Platform.data_parallel_devices``) on four devices."""

    name = "four"
    data_parallel_devices = Platform.data_parallel_devices

    def device_count(self) -> int:
        return 4


def test_the_platform_places_each_engine_on_its_own_devices() -> None:
    four = FourDevices()
    assert [four.data_parallel_devices(i, 2, 2) for i in range(2)] == [[0, 1], [2, 3]]
    assert [four.data_parallel_devices(i, 4, 1) for i in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="-size 3 with --tensor-parallel-size 2 needs 6 four"):
        four.data_parallel_devices(0, 3, 2)
    cpu, cores = CpuPlatform(), len(os.sched_getaffinity(0))
    assert cpu.data_parallel_devices(1, cores, 1) == [0]  # every rank on the host
    with pytest.raises(ValueError, match=f"needs a core per rank \\({cores + 1}\\)"):
        cpu.data_parallel_devices(0, cores + 1, 1)
    assert engine_rank_devices(EngineConfig(data_parallel_size=2, data_parallel_rank=1)) == [0]


# -- two real engine cores --------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> dict[str, Any]:
    """One engine's answers (the offline LLM, in this process)."""
    llm = LLM(str(tiny_llama_dir), **TINY_ENGINE)
    try:
        return {
            "greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)],
            "seeded": llm.generate(PROMPTS[0], SEEDED)[0].outputs[0].token_ids,
        }
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = tiny_async_llm(
        tiny_llama_dir, data_parallel_size=2, enable_sleep_mode=True, stat_loggers=[]
    )
    yield llm
    llm.shutdown_sync()


async def final_output(engine, prompt: str, params: SamplingParams, request_id: str) -> Any:
    outputs = [o async for o in engine.generate(prompt, params, request_id, delta=False)]
    assert outputs and outputs[-1].finished
    return outputs[-1]


async def tokens(engine, prompt: str, params: SamplingParams, request_id: str) -> list[int]:
    return list((await final_output(engine, prompt, params, request_id)).outputs[0].token_ids)


def sent_since(engine, before: list[int]) -> list[int]:
    return [now - then for now, then in zip(engine.client.num_sent, before, strict=True)]


async def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def test_concurrent_greedy_requests_match_one_engine_on_both_engines(engine, expected) -> None:
    assert engine.client.size == 2 and len(engine.engine_infos) == 2
    before = list(engine.client.num_sent)

    async def main() -> list[list[int]]:
        return await asyncio.gather(
            *(tokens(engine, p, GREEDY, f"greedy-{i}") for i, p in enumerate(PROMPTS))
        )

    assert asyncio.run(main()) == expected["greedy"]
    assert sent_since(engine, before) == [4, 4]
    assert engine.client.num_unfinished == [0, 0]


def test_seeded_requests_give_the_same_tokens_on_either_engine(engine, expected) -> None:
    before = list(engine.client.num_sent)

    async def main() -> list[list[int]]:
        return await asyncio.gather(
            *(tokens(engine, PROMPTS[0], SEEDED, f"seeded-{i}") for i in range(4))
        )

    assert asyncio.run(main()) == [expected["seeded"]] * 4
    assert sent_since(engine, before) == [2, 2]


def test_structured_outputs_run_on_both_engines(engine) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs={"choice": ["yes", "no", "maybe"]}
    )
    before = list(engine.client.num_sent)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(final_output(engine, PROMPTS[i], params, f"choice-{i}") for i in (0, 1))
        )

    assert all(o.outputs[0].text in ("yes", "no", "maybe") for o in asyncio.run(main()))
    assert sent_since(engine, before) == [1, 1]


def test_an_aborted_request_frees_its_engine_slot(engine) -> None:
    async def main() -> None:
        streams = {name: engine.generate(PROMPTS[0], LONG, name) for name in "ABC"}
        for stream in streams.values():  # A -> 0, B -> 1, C -> 0
            await stream.__anext__()
        assert engine.client.num_unfinished == [2, 1]
        await wait_until(lambda: engine.stats().num_running == 3, "3 run (summed stats)")
        await streams.pop("A").aclose()  # aborts A
        assert engine.client.num_unfinished == [1, 1]
        await wait_until(lambda: engine.client.engine_stats[0].num_running == 1, "A is gone")
        before = list(engine.client.num_sent)
        streams["D"] = engine.generate(PROMPTS[1], LONG, "D")
        await streams["D"].__anext__()
        assert sent_since(engine, before) == [1, 0]  # A's place on engine 0, a tie
        for stream in streams.values():
            await stream.aclose()
        await wait_until(lambda: engine.stats().num_running == 0, "all aborted")
        assert engine.client.num_unfinished == [0, 0]

    asyncio.run(main())


def test_utility_calls_reach_every_engine(engine, expected) -> None:
    def on_each(method: str) -> list[Any]:
        return [c.call_utility(method).result(10) for c in engine.client.clients]

    async def main() -> None:
        assert await engine.reset_prefix_cache() is True
        await engine.pause_generation()
        assert await engine.is_paused() and on_each("is_paused") == [True, True]
        await engine.resume_generation()
        assert on_each("is_paused") == [False, False]
        await engine.sleep(1)
        assert await engine.is_sleeping() and on_each("is_sleeping") == [True, True]
        with pytest.raises(EngineSleepingError):
            await tokens(engine, PROMPTS[0], GREEDY, "asleep")
        await engine.wake_up()
        assert on_each("is_sleeping") == [False, False] and not await engine.is_sleeping()
        awake = await asyncio.gather(*(tokens(engine, p, GREEDY, f"awake-{p}") for p in PROMPTS))
        assert awake == expected["greedy"]  # level 1 on the CPU: the weights stayed

    asyncio.run(main())


def metric(text: str, name: str, engine: int) -> float:
    match = re.search(rf'^chassis:{name}\{{engine="{engine}",[^}}]*\}} (\S+)$', text, re.MULTILINE)
    assert match is not None, f"{name} of engine {engine} not in /metrics"
    return float(match.group(1))


def test_the_server_serves_from_both_engines(engine, expected) -> None:
    async def one_each() -> None:
        await asyncio.gather(*(tokens(engine, PROMPTS[i], GREEDY, f"srv-{i}") for i in (0, 1)))

    asyncio.run(one_each())  # so that both engines have looked up prompts
    settings = ServerSettings(server_dev_mode=True, shutdown_engine_on_exit=False)
    with TestClient(build_app(engine, settings)) as client:
        body = {"model": engine.model_name, "prompt": PROMPTS[0], "max_tokens": 8}
        response = client.post("/v1/completions", json={**body, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        chat = {
            "model": engine.model_name,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        info = client.get("/server_info").json()
        assert info["engine_config"]["data_parallel_size"] == 2
        assert [e["num_kv_blocks"] for e in info["engines"]] == [64, 64]
        assert info["total_kv_capacity_tokens"] == 2 * 64 * 16
        assert info["engine_info"]["kv_capacity_tokens"] == 64 * 16
        text = client.get("/metrics").text
        per_engine = engine.client.engine_stats
        assert all(s.prefix_cache_queries > 0 for s in per_engine)
        queries = [metric(text, "prefix_cache_queries_total", i) for i in (0, 1)]
        assert queries == [s.prefix_cache_queries for s in per_engine]  # each engine's own
        assert sum(queries) == engine.stats().prefix_cache_queries  # summing gives the total
        assert [metric(text, "num_requests_running", i) for i in (0, 1)] == [0, 0]
        # a request counts under the engine that ran it: one at a time, both ran on engine
        # 0 (a tie each time); engine 1's series are there from the start, at 0
        assert metric(text, "prompt_tokens_total", 0) > 0
        assert metric(text, "prompt_tokens_total", 1) == 0
        assert metric(text, "e2e_request_latency_seconds_count", 0) == 2
        assert client.get("/health").status_code == 200


def test_one_engine_killed_means_the_server_is_dead(engine) -> None:
    """Last: it kills the module's engine."""
    settings = ServerSettings(shutdown_engine_on_exit=False)
    with TestClient(build_app(engine, settings)) as client:
        os.kill(engine.client.clients[1].process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not engine.errored:
            assert time.monotonic() < deadline, "the death was not noticed"
            time.sleep(0.05)
        assert client.get("/health").status_code == 503
    with pytest.raises(EngineDeadError, match="data-parallel engine 1"):
        asyncio.run(engine.check_health())
    # The other engine is shut down. (Polled: several threads wait for the process, and
    # is_alive() can say True while another of them is reaping it.)
    other = engine.client.clients[0].process
    deadline = time.monotonic() + 30
    while other.is_alive():
        assert time.monotonic() < deadline, "the other engine still runs"
        time.sleep(0.05)
    with pytest.raises(EngineDeadError):
        asyncio.run(tokens(engine, PROMPTS[0], GREEDY, "dead"))
