"""Data parallelism with what each engine runs on its own: LoRA adapters, speculative
decoding, a pooling runner, images.

Each test starts one ``AsyncLLM`` with two engine cores (``data_parallel_size=2``, one rank
each) on a tiny float32 checkpoint, sends concurrent requests that routing spreads over both
engines (asserted: each engine ran its share), and compares every answer with one engine's
(the offline ``LLM`` in this process). The per-engine ``/metrics`` series are checked where
the feature has its own: adapters in use, speculative-decoding counters, pooled requests.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import torch
from engines import TINY_ENGINE, tiny_async_llm
from fixtures_llava import random_image, save_tiny_llava
from fixtures_lora import write_peft_adapter

from chassis.core.llm import LLM
from chassis.core.lora import LoRARequest
from chassis.core.pooling_params import PoolingParams
from chassis.core.sampling_params import SamplingParams
from chassis.serve.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: prompts that repeat themselves: n-gram drafts find matches and get accepted
REPEATING = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 11, 12, 13, 11, 12, 13, 11],
    [21, 22, 23, 24, 21, 22, 23, 24, 21, 22],
    [31, 32, 31, 32, 31, 32, 31, 32, 31],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
#: prompts whose greedy continuations (the tiny random Llama) repeat earlier n-grams (all
#: but the third); sent in order, each engine gets at least one
SPEC_PROMPTS = [
    "one two three four one two three four one two three",
    "a b c a b c a b c a b c a b",
    "The capital of France is",
    "x y x y x y x y x y x y x y x y x y",
]
LONG_GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


async def greedy_tokens(
    engine: Any,
    prompt: Any,
    request_id: str,
    params: SamplingParams = GREEDY,
    metrics: ServerMetrics | None = None,
    **kwargs: Any,
) -> list[int]:
    """The request's tokens, streamed as the server streams them (deltas), each output
    counted in ``metrics`` as the server counts it when given."""
    tracker = None if metrics is None else metrics.tracker()
    tokens: list[int] = []
    finished = False
    async for output in engine.generate(prompt, params, request_id, **kwargs):
        if tracker is not None:
            tracker.observe(output)
        tokens += output.outputs[0].token_ids if output.outputs else []
        finished = output.finished
    assert finished
    return tokens


def run_all(coroutines: list[Any]) -> list[Any]:
    """The coroutines' results, run at once (sent in order: routing alternates 0, 1, ...)."""

    async def main() -> list[Any]:
        return await asyncio.gather(*coroutines)

    return asyncio.run(main())


def metric_values(metrics: ServerMetrics, name: str) -> dict[str, float]:
    """``metrics``' series ``chassis:{name}`` by engine label."""
    text = metrics.render()[0].decode()
    pattern = rf'^chassis:{name}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def test_lora_adapters_on_both_engines(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Each adapter's requests run on both engines (each loads the adapter itself) and get
    the one-engine tokens; the base model's too."""
    first = write_peft_adapter(tmp_path / "first", tiny_llama_dir, rank=8, seed=1)
    second = write_peft_adapter(
        tmp_path / "second", tiny_llama_dir, rank=4, targets=("q_proj", "v_proj"), seed=2
    )
    adapters = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))]
    # sent in this order, engine 0 gets first, second, base; engine 1 the same
    loras = [adapters[0], adapters[0], adapters[1], adapters[1], None, None]
    prompts = [REPEATING[i % 2] for i in range(len(loras))]
    settings = {**TINY_ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    llm = LLM(str(tiny_llama_dir), **settings)
    try:
        outputs = llm.generate(prompts, GREEDY, lora_request=loras)
        expected = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
    assert len({tuple(t) for t in expected}) > 2  # the adapters change the tokens

    engine = tiny_async_llm(tiny_llama_dir, data_parallel_size=2, stat_loggers=[], **settings)
    try:
        got = run_all(
            [
                greedy_tokens(
                    engine, prompt, f"lora-{i}", **({"lora_request": lora} if lora else {})
                )
                for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True))
            ]
        )
        assert got == expected
        assert engine.client.num_sent == [3, 3]
        info = metric_values(ServerMetrics.of_engine(engine), "lora_requests_info")
        assert sorted(info) == ["0", "1"]  # each engine's adapters, labelled
    finally:
        engine.shutdown_sync()


def test_speculative_decoding_on_both_engines(tiny_llama_dir: Path) -> None:
    """n-gram drafts verified on both engines; greedy tokens equal one engine's (which
    drafts nothing), and each engine's counters are its own series."""
    llm = LLM(str(tiny_llama_dir), **TINY_ENGINE)
    try:
        outputs = llm.generate(SPEC_PROMPTS, LONG_GREEDY)
        expected = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
    engine = tiny_async_llm(
        tiny_llama_dir, data_parallel_size=2, speculative_config=NGRAM, stat_loggers=[]
    )
    metrics = ServerMetrics.of_engine(engine)
    try:
        got = run_all(
            [
                greedy_tokens(engine, p, f"spec-{i}", LONG_GREEDY, metrics)
                for i, p in enumerate(SPEC_PROMPTS)
            ]
        )
        assert got == expected
        assert engine.client.num_sent == [2, 2]
        # each request counted under the engine that ran it: 0 and 2 on engine 0
        assert metric_values(metrics, "generation_tokens_total") == {"0": 96.0, "1": 96.0}
        assert metric_values(metrics, "e2e_request_latency_seconds_count") == {
            "0": 2.0,
            "1": 2.0,
        }
        per_engine = engine.engine_stats()
        assert all(s.spec_num_draft_tokens > 0 for s in per_engine), per_engine
        drafted = metric_values(metrics, "spec_decode_num_draft_tokens_total")
        assert drafted == {str(i): float(s.spec_num_draft_tokens) for i, s in enumerate(per_engine)}
        assert sum(drafted.values()) == engine.stats().spec_num_draft_tokens
    finally:
        engine.shutdown_sync()


def test_pooling_on_both_engines(tiny_llama_dir: Path) -> None:
    """Embeddings from two engines equal one engine's; each output names its engine."""
    settings = {**TINY_ENGINE, "runner": "pooling", "enforce_eager": True}
    llm = LLM(str(tiny_llama_dir), **settings)
    try:
        expected = [o.outputs.embedding for o in llm.embed(REPEATING)]
    finally:
        llm.shutdown()
    engine = tiny_async_llm(tiny_llama_dir, data_parallel_size=2, stat_loggers=[], **settings)

    async def embed(prompt: list[int], request_id: str) -> Any:
        async for output in engine.encode(prompt, PoolingParams(), request_id):
            return output
        raise AssertionError("no output")

    try:
        outputs = run_all([embed(p, f"embed-{i}") for i, p in enumerate(REPEATING)])
        for output, vector in zip(outputs, expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(output.outputs.embedding), torch.tensor(vector), atol=1e-5, rtol=0
            )
        assert engine.client.num_sent == [2, 2]
        assert [o.metrics.engine_index for o in outputs] == [0, 1, 0, 1]
        metrics = ServerMetrics.of_engine(engine)
        for output in outputs:
            metrics.observe_pooled(output, 0.1)  # as the embeddings route counts it
        tokens = metric_values(metrics, "prompt_tokens_total")
        assert tokens == {"0": 13.0 + 10.0, "1": 10.0 + 9.0}  # REPEATING's lengths
    finally:
        engine.shutdown_sync()


def test_images_on_both_engines(tmp_path: Path) -> None:
    """A tiny LLaVA: prompts with images (and one without) give one engine's greedy tokens."""
    model_dir = save_tiny_llava(tmp_path / "llava")
    images = [random_image(56, 56, seed=s) for s in range(3)]
    prompts: list[Any] = [
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": [im]}}
        for im in images
    ] + ["USER: Hello there. ASSISTANT:"]
    settings = {**TINY_ENGINE, "block_size": 16}
    llm = LLM(str(model_dir), **settings)
    try:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    assert len({tuple(t) for t in expected[:3]}) > 1  # the images matter
    engine = tiny_async_llm(model_dir, data_parallel_size=2, stat_loggers=[], **settings)

    def request(prompt: Any, i: int) -> Any:
        if isinstance(prompt, str):
            return greedy_tokens(engine, prompt, f"image-{i}")
        return greedy_tokens(
            engine, prompt["prompt"], f"image-{i}", multi_modal_data=prompt["multi_modal_data"]
        )

    try:
        got = run_all([request(p, i) for i, p in enumerate(prompts)])
        assert got == expected
        assert engine.client.num_sent == [2, 2]
    finally:
        engine.shutdown_sync()
