"""Embeddings (``runner="pooling"``): ``LLM.embed`` against HF transformers' hidden states.

The reference is ``AutoModel`` (the decoder without its LM head) in float32: its
``last_hidden_state`` pooled the same way (last token, mean or first token) and
L2-normalized. Batches mix prompt lengths, and a token budget smaller than the longest prompt
makes it run over several steps (chunked prefill).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from chassis.core.engine_core import EngineCore
from chassis.core.llm import LLM
from chassis.core.pooler import finish_vector, pool_reference
from chassis.core.pooling_config import PoolerConfig, read_sentence_transformers_pooling
from chassis.core.pooling_input import process_pooling
from chassis.core.pooling_outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    decode_pooled,
    encode_pooled,
)
from chassis.core.pooling_params import PoolingParams
from chassis.core.request import EngineCoreRequest, FinishReason
from chassis.core.sampling_params import SamplingParams

TOLERANCE = 1e-5
#: a token budget below the longest prompts: they are computed over several steps
BUDGET = 24


def pooling_llm(model_dir: Path | str, **kwargs: Any) -> LLM:
    """A float32 pooling engine of ``model_dir`` whose token budget (BUDGET) is below the
    longest test prompts; ``kwargs`` override any setting."""
    settings: dict[str, Any] = {
        "runner": "pooling",
        "dtype": "float32",
        "max_model_len": 128,
        "num_kv_blocks": 64,
        "max_num_batched_tokens": BUDGET,
        "enforce_eager": True,
    }
    settings.update(kwargs)
    return LLM(str(model_dir), **settings)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (3 to 48999) of the given lengths, the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _reference(
    hf_model: Any,
    token_ids: list[int],
    pooling_type: str,
    *,
    normalize: bool = True,
    dimensions: int | None = None,
) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_model(torch.tensor([token_ids])).last_hidden_state[0]
    return finish_vector(pool_reference(hidden, pooling_type), dimensions, normalize)


def _assert_matches(
    hf_model: Any,
    outputs: list[EmbeddingRequestOutput],
    pooling_type: str,
    normalize: bool | list[bool] = True,
) -> None:
    flags = normalize if isinstance(normalize, list) else [normalize] * len(outputs)
    for output, flag in zip(outputs, flags, strict=True):
        expected = _reference(hf_model, output.prompt_token_ids, pooling_type, normalize=flag)
        got = torch.tensor(output.outputs.embedding)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_last_token_pooling_matches_hf(tiny_llama_dir: Path, hf_model: Any) -> None:
    llm = pooling_llm(tiny_llama_dir)
    assert llm.pooler_config == PoolerConfig("LAST", True)  # vLLM's default for decoder LMs
    assert llm.config.enable_prefix_caching  # the last token needs no earlier states
    long_ids = random_prompts([100])[0]  # > 4 x the token budget
    prompts = ["Hello world", long_ids, {"prompt_token_ids": [5, 6, 7]}, "a " * 30, [42]]
    outputs = llm.embed(prompts)

    assert len(outputs) == len(prompts)
    for output in outputs:
        assert isinstance(output, EmbeddingRequestOutput)
        assert isinstance(output.outputs, EmbeddingOutput)
        assert output.finished and isinstance(output.request_id, str)
        assert output.outputs.hidden_size == 64
        assert all(type(x) is float for x in output.outputs.embedding)
        assert abs(torch.tensor(output.outputs.embedding).norm().item() - 1.0) < 1e-5
    assert outputs[0].prompt_token_ids == llm.get_tokenizer()("Hello world").input_ids
    assert outputs[0].prompt == "Hello world"
    assert outputs[1].prompt_token_ids == long_ids
    assert outputs[2].prompt_token_ids == [5, 6, 7]
    assert len({o.request_id for o in outputs}) == len(outputs)
    _assert_matches(hf_model, outputs, "LAST")


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_hf(
    tiny_llama_dir: Path, hf_model: Any, pooling_type: str
) -> None:
    llm = pooling_llm(tiny_llama_dir, pooler_config={"pooling_type": pooling_type.lower()})
    assert llm.pooler_config == PoolerConfig(pooling_type, True)
    # a prefix-cache hit would skip hidden states these poolers read
    assert not llm.config.enable_prefix_caching
    prompts = random_prompts([100, 3, 50, 1, 24, 25, 70])
    params = [PoolingParams(normalize=i % 3 != 1) for i in range(len(prompts))]
    outputs = llm.embed(prompts, params)
    _assert_matches(hf_model, outputs, pooling_type, [p.normalize for p in params])


def _sentence_transformers_copy(
    source: Path, target: Path, pooling: dict[str, Any], normalize: bool
) -> Path:
    shutil.copytree(source, target)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (target / "2_Normalize").mkdir()
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **pooling})
    )
    return target


_ST_MODES = {
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": False,
}


@pytest.mark.parametrize(
    ("mode", "pooling_type", "normalize"),
    [
        ("pooling_mode_mean_tokens", "MEAN", True),
        ("pooling_mode_cls_token", "CLS", False),
        ("pooling_mode_lasttoken", "LAST", False),
    ],
)
def test_sentence_transformers_config_is_read(
    tiny_llama_dir: Path,
    hf_model: Any,
    tmp_path: Path,
    mode: str,
    pooling_type: str,
    normalize: bool,
) -> None:
    model_dir = _sentence_transformers_copy(
        tiny_llama_dir, tmp_path / "st", {**_ST_MODES, mode: True}, normalize
    )
    llm = pooling_llm(model_dir)
    assert llm.pooler_config == PoolerConfig(pooling_type, normalize)
    outputs = llm.embed(random_prompts([60, 7, 31], seed=1))
    _assert_matches(hf_model, outputs, pooling_type, normalize)
    if not normalize:  # the raw pooled state, as sentence-transformers without Normalize
        assert abs(torch.tensor(outputs[0].outputs.embedding).norm().item() - 1.0) > 1e-3


def test_pooler_config_overrides_sentence_transformers(
    tiny_llama_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    model_dir = _sentence_transformers_copy(
        tiny_llama_dir,
        tmp_path / "st",
        {**_ST_MODES, "pooling_mode_mean_tokens": True},
        normalize=True,
    )
    # vLLM's older names: task="embed", override_pooler_config
    llm = LLM(
        str(model_dir),
        task="embed",
        override_pooler_config={"pooling_type": "LAST"},
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        enforce_eager=True,
    )
    assert llm.config.runner == "pooling"
    assert llm.pooler_config == PoolerConfig("LAST", True)  # normalize still from the files
    _assert_matches(hf_model, llm.embed(["some text to embed"]), "LAST")


def test_sentence_transformers_files_chassis_cannot_run(tmp_path: Path) -> None:
    def write(pooling: dict[str, Any], extra_module: str | None = None) -> Path:
        directory = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        directory.mkdir()
        modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if extra_module is not None:
            modules.append({"path": "2", "type": extra_module})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return directory

    with pytest.raises(ValueError, match="pooling median is not supported"):
        read_sentence_transformers_pooling(write({"pooling_mode": "median"}))
    with pytest.raises(ValueError, match="several pooling modes"):
        read_sentence_transformers_pooling(
            write({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True})
        )
    with pytest.raises(ValueError, match=r"cannot run: sentence_transformers\.models\.LSTM"):
        read_sentence_transformers_pooling(
            write({"pooling_mode_mean_tokens": True}, "sentence_transformers.models.LSTM")
        )
    with pytest.raises(ValueError, match=r"WordWeights \(a weight per vocabulary token"):
        read_sentence_transformers_pooling(
            write({"pooling_mode_mean_tokens": True}, "sentence_transformers.models.WordWeights")
        )
    # Dense and LayerNorm modules are run (tests/test_embeddings_dense.py); max, sqrt-length
    # and weighted means too
    assert read_sentence_transformers_pooling(write({"pooling_mode_max_tokens": True})) == {
        "normalize": False,
        "pooling_type": "MAX",
    }
    # the string form of newer sentence-transformers versions
    assert read_sentence_transformers_pooling(write({"pooling_mode": "mean"})) == {
        "normalize": False,
        "pooling_type": "MEAN",
    }
    assert read_sentence_transformers_pooling(tmp_path / "no-such-model") is None


def test_matryoshka_dimensions(tiny_llama_dir: Path, hf_model: Any, tmp_path: Path) -> None:
    plain = pooling_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        plain.embed(["text"], PoolingParams(dimensions=16))

    model_dir = tmp_path / "matryoshka"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = pooling_llm(model_dir)
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\]"):
        llm.embed(["text"], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="dimensions: must be >= 1"):
        PoolingParams(dimensions=0)
    prompts = random_prompts([40, 9])
    outputs = llm.embed(prompts, [PoolingParams(dimensions=16), PoolingParams()])
    # the first 16 values, normalized on their own (not a slice of the normalized vector)
    expected = _reference(hf_model, prompts[0], "LAST", dimensions=16)
    torch.testing.assert_close(
        torch.tensor(outputs[0].outputs.embedding), expected, atol=TOLERANCE, rtol=0
    )
    assert outputs[1].outputs.hidden_size == 64


def test_last_token_pooling_reuses_the_prefix_cache(tiny_llama_dir: Path, hf_model: Any) -> None:
    llm = pooling_llm(tiny_llama_dir)
    prompt = random_prompts([70], seed=3)[0]
    first = llm.embed([prompt])[0]
    again = llm.embed([prompt])[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # the full blocks before the last token
    torch.testing.assert_close(
        torch.tensor(again.outputs.embedding),
        torch.tensor(first.outputs.embedding),
        atol=TOLERANCE,
        rtol=0,
    )
    _assert_matches(hf_model, [again], "LAST")


def run_low_then_high(llm: LLM, low: list[int], high: list[int]) -> dict[str, Any]:
    """Drive ``llm``'s engine by hand: pooling request ``"low"`` (priority 5, prompt ``low``)
    alone for three steps, then ``"high"`` (priority 0) too until both finish; their outputs
    by request id (with a budget and blocks for one of them, ``"high"`` preempts ``"low"``)."""
    engine = llm.engine

    def request(ids: list[int], request_id: str, priority: int) -> EngineCoreRequest:
        return process_pooling(
            llm.input_processor, llm.embedding_info, ids, PoolingParams(), request_id, priority
        )

    engine.add_request(request(low, "low", 5))
    results = {}
    for _ in range(3):  # 48 of 60 tokens at a budget of 16 (planned, when async)
        results.update({o.request_id: o for o in engine.step().outputs})
    engine.add_request(request(high, "high", 0))
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step().outputs})
    return results


def _check_preempted_mean_request(
    model_dir: Path, hf_model: Any, seed: int, **engine_kwargs: Any
) -> None:
    """A low-priority 60-token MEAN prompt preempted (by recompute) after three 16-token steps
    by a high-priority one: one preemption, and both vectors equal HF's."""
    llm = pooling_llm(
        model_dir,
        max_model_len=64,
        num_kv_blocks=4,  # one 64-token sequence
        max_num_batched_tokens=16,
        scheduler="priority",
        pooler_config={"pooling_type": "MEAN"},
        **engine_kwargs,
    )
    low, high = random_prompts([60, 60], seed=seed)
    results = run_low_then_high(llm, low, high)
    assert llm.engine.scheduler.num_preemptions == 1
    for request_id, ids in (("low", low), ("high", high)):
        assert results[request_id].finish_reason == FinishReason.STOP
        got = torch.tensor(decode_pooled(results[request_id].pooled))
        torch.testing.assert_close(got, _reference(hf_model, ids, "MEAN"), atol=TOLERANCE, rtol=0)


def test_preempted_mean_request_starts_its_sum_again(tiny_llama_dir: Path, hf_model: Any) -> None:
    """A low-priority prompt preempted half-way (by recompute) pools all its tokens once."""
    _check_preempted_mean_request(tiny_llama_dir, hf_model, seed=4)


def test_pooled_bytes_round_trip() -> None:
    """The engine's float32 bytes -> Python floats -> the same bytes (what base64 sends)."""
    data = torch.randn(64).numpy().astype("<f4").tobytes()
    floats = decode_pooled(data)
    assert all(type(x) is float for x in floats)
    assert encode_pooled(floats) == data


def test_input_checks(tiny_llama_dir: Path) -> None:
    llm = pooling_llm(tiny_llama_dir, max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length is 32"):
        llm.embed([list(range(3, 36))])
    # a pooling prompt may fill the whole context (nothing is generated after it)
    assert len(llm.embed([list(range(3, 35))])[0].prompt_token_ids) == 32
    truncated = llm.embed([list(range(3, 43))], truncate_prompt_tokens=10)[0]
    assert truncated.prompt_token_ids == list(range(33, 43))
    assert (
        len(
            llm.embed([list(range(3, 60))], PoolingParams(truncate_prompt_tokens=-1))[
                0
            ].prompt_token_ids
        )
        == 32
    )
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.embed([[10**6]])
    with pytest.raises(ValueError, match="got 1 pooling params for 2 prompts"):
        llm.embed(["a", "b"], [PoolingParams()])
    # a pooling request is not sampled: a ValueError that says what embed() takes
    with pytest.raises(ValueError, match="must be a PoolingParams or a list of them"):
        llm.embed(["a"], SamplingParams(n=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a PoolingParams"):
        llm.embed(["a"], [SamplingParams()])  # type: ignore[list-item]
    # a truncation size above the context is refused whatever the input's length (vLLM's
    # rule and message); the context length itself is allowed
    for ids in ([5, 6, 7], list(range(3, 60))):
        with pytest.raises(
            ValueError,
            match=r"^truncate_prompt_tokens value \(1000\) is greater than max_model_len \(32\)",
        ):
            llm.embed([ids], truncate_prompt_tokens=1000)
    assert len(llm.embed([[5, 6, 7]], truncate_prompt_tokens=32)[0].prompt_token_ids) == 3


def test_an_engine_runs_one_kind_of_request(tiny_llama_dir: Path) -> None:
    pooling = pooling_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="use embed"):
        pooling.generate(["Hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="use embed"):
        pooling.chat([{"role": "user", "content": "Hi"}])
    generating = LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True
    )
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.embed(["Hello"])

    # The engine core itself refuses a request of the other kind (finished with "abort").
    core: EngineCore = pooling.engine
    core.add_request(
        EngineCoreRequest(
            request_id="gen", prompt_token_ids=[5, 6], sampling_params=SamplingParams()
        )
    )
    outputs = core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("gen", FinishReason.ABORT)]
    generating.engine.add_request(
        process_pooling(
            pooling.input_processor, pooling.embedding_info, [5, 6], PoolingParams(), "pool"
        )
    )
    outputs = generating.engine.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("pool", FinishReason.ABORT)]


def test_a_scheduler_that_cannot_finish_pooling_requests_is_refused(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler plugin that ignores ``ModelRunnerOutput.pooled`` would never finish a
    pooling request: the engine refuses it at start-up instead of hanging."""
    from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler

    monkeypatch.setattr(FcfsScheduler, "supports_pooling", False)
    with pytest.raises(ValueError, match="'fcfs' does not finish pooling requests"):
        pooling_llm(tiny_llama_dir)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"runner": "embed"}, "--runner must be one of"),
        ({"runner": "generate", "pooler_config": {"pooling_type": "MEAN"}}, "for --runner pooling"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "STEP"}}, "pooling_type must be"),
        ({"runner": "pooling", "pooler_config": {"normalise": True}}, "unknown keys"),
        ({"task": "classify"}, "task='classify' is not supported"),
        ({"task": "embed", "runner": "generate"}, "disagree"),
    ],
)
def test_settings_refused(tiny_llama_dir: Path, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), **settings)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_two_ranks_pool_as_one(tiny_llama_dir: Path, pooling_type: str) -> None:
    """Tensor parallelism: every rank computes the full hidden states and pools them alike
    (chunked prompts keep the same running state on each rank); the driver's vectors equal
    a single rank's."""
    prompts = random_prompts([100, 3, 50, 1, 25, 70], seed=1)
    params = [PoolingParams(normalize=i % 2 == 0) for i in range(len(prompts))]
    pooler_config = {"pooling_type": pooling_type}
    one = pooling_llm(tiny_llama_dir, pooler_config=pooler_config)
    expected = [o.outputs.embedding for o in one.embed(prompts, params)]
    one.shutdown()
    two = pooling_llm(tiny_llama_dir, pooler_config=pooler_config, tensor_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in two.embed(prompts, params)]
        # a second batch on the same ranks: their pooler states were left in step
        again = [o.outputs.embedding for o in two.embed(prompts[::-1], params[::-1])]
    finally:
        two.shutdown()
    for vectors in (got, again[::-1]):
        for g, e in zip(vectors, expected, strict=True):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_async_scheduling_pools_as_sync(tiny_llama_dir: Path, pooling_type: str) -> None:
    """Async scheduling plans step N+1 before step N's vectors are collected. A pooling
    request is planned nothing after the step that completes its prompt (its one in-flight
    output finishes it: ``SamplingParams(max_tokens=1)``), its vector comes with that step's
    collection, and the vectors equal a synchronous engine's."""
    prompts = random_prompts([100, 3, 50, 1, 25, 70], seed=2)
    params = [PoolingParams(normalize=i % 2 == 0) for i in range(len(prompts))]
    pooler_config = {"pooling_type": pooling_type}
    expected = pooling_llm(tiny_llama_dir, pooler_config=pooler_config).embed(prompts, params)
    llm = pooling_llm(tiny_llama_dir, pooler_config=pooler_config, async_scheduling=True)
    engine = llm.engine
    scheduled: dict[str, int] = {}
    launch = engine.executor.execute_model_async

    def recording_launch(plan: Any) -> Any:
        for request_id, n in plan.num_scheduled_tokens.items():
            scheduled[request_id] = scheduled.get(request_id, 0) + n
        return launch(plan)

    engine.executor.execute_model_async = recording_launch  # type: ignore[method-assign]
    got = llm.embed(prompts, params)
    # every token once (no preemption here), and no step planned past a prompt
    assert sorted(scheduled.values()) == sorted(len(p) for p in prompts)
    assert engine.scheduler.num_preemptions == 0
    for g, e in zip(got, expected, strict=True):
        assert g.prompt_token_ids == e.prompt_token_ids
        torch.testing.assert_close(
            torch.tensor(g.outputs.embedding), torch.tensor(e.outputs.embedding), atol=1e-5, rtol=0
        )
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.num_free_blocks == engine.info.num_kv_blocks


def test_async_scheduling_preempted_mean_request(tiny_llama_dir: Path, hf_model: Any) -> None:
    """Async scheduling with a prompt preempted half-way (by recompute): its running sum
    starts again, and both vectors still match HF."""
    _check_preempted_mean_request(tiny_llama_dir, hf_model, seed=5, async_scheduling=True)
