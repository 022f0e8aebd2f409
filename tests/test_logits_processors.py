"""Custom logits processors (``--logits-processors``): the registry and the flag, the batch
updates a processor is told, the built-in ``no_repeat_ngram`` against transformers' processor
and in real engine runs (sync, async scheduling, speculative decoding), and ``vllm_xargs``
through the API server.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.logits_processors.no_repeat_ngram import (
    NoRepeatNGramLogitsProcessor as ChassisNoRepeat,
)
from chassis.builtin_plugins.samplers.default import DefaultSampler
from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.input_batch import InputBatch, RequestState
from chassis.core.logits_processor import (
    AddedRequest,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsRows,
    check_logits_processors,
    resolve_logits_processor,
)
from chassis.core.sampler_interface import Sampler
from chassis.serve.app import build_app
from chassis.serve.args import add_engine_args, engine_config_from_args
from chassis.serve.settings import ServerSettings

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello hello"]
FORCED = f"{__name__}:ForcedTokens"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


class ForcedTokens(LogitsProcessor):
    """Test processor: a request with ``extra_args={"force_from": b}`` writes ``b, b + 1,
    ...``; its rows are known only from the batch updates, so any mistake in them (a wrong
    row, a stale output list) shows up in the tokens. Cannot verify drafts."""

    VOCAB = 1000

    def __init__(self, config, device, pin_memory) -> None:
        super().__init__(config, device, pin_memory)
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self.num_moved = self.num_removed = self.num_added = 0
        self.batch_size = 0

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get("force_from", 0)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid sampling parameter extra_args: bad force_from {value!r}")

    @classmethod
    def acts_on(cls, params: SamplingParams) -> bool:
        return "force_from" in (params.extra_args or {})

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        for row in update.removed:
            self.rows.pop(row, None)
        for move in update.moved:
            entry = self.rows.pop(move.src, None)
            if entry is None:
                self.rows.pop(move.dst, None)
            else:
                self.rows[move.dst] = entry
        for added in update.added:
            base = (added.params.extra_args or {}).get("force_from")
            if base is None:
                self.rows.pop(added.row, None)
            else:
                self.rows[added.row] = (base, added.output_token_ids)
        self.num_moved += len(update.moved)
        self.num_removed += len(update.removed)
        self.num_added += len(update.added)
        self.batch_size = update.batch_size
        assert all(row < update.batch_size for row in self.rows)

    def apply(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        for i, row in enumerate(rows.batch_rows.tolist()):
            entry = self.rows.get(row)
            if entry is not None:
                base, output = entry
                assert not rows.draft_prefix(i)  # its requests get no drafts
                logits[i] = float("-inf")
                logits[i, (base + len(output)) % self.VOCAB] = 0.0
        return logits


class NotAProcessor:
    pass


# -- registry, flag, config ------------------------------------------------------------------


def test_names_resolve_and_unknown_ones_list_the_known():
    assert resolve_logits_processor("no_repeat_ngram") is ChassisNoRepeat
    assert resolve_logits_processor(FORCED) is ForcedTokens
    with pytest.raises(ValueError, match=r"unknown logits processor 'nope'; known: .*no_repeat"):
        resolve_logits_processor("nope")
    with pytest.raises(ValueError, match=r"not a subclass of .*LogitsProcessor"):
        resolve_logits_processor(f"{__name__}:NotAProcessor")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_logits_processor("no_such_module_x:Thing")


def test_flag_takes_commas_and_spaces_and_config_checks_it():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    args = parser.parse_args(["m", "--logits-processors", "a,b", "pkg.mod:C"])
    assert engine_config_from_args(args).logits_processors == ["a", "b", "pkg.mod:C"]
    assert engine_config_from_args(parser.parse_args(["m"])).logits_processors == []
    with pytest.raises(ValueError, match="--logits-processors cannot be combined with --runner"):
        EngineConfig(runner="pooling", logits_processors=["no_repeat_ngram"])
    with pytest.raises(ValueError, match="twice"):
        check_logits_processors(["no_repeat_ngram", "no_repeat_ngram"], DefaultSampler, "d")


def test_a_sampler_that_does_not_run_processors_is_refused():
    class Plain(Sampler):
        def __call__(self, logits, metadata):
            raise NotImplementedError

    with pytest.raises(ValueError, match="sampler 'plain' does not"):
        check_logits_processors(["no_repeat_ngram"], Plain, "plain")
    assert check_logits_processors(["no_repeat_ngram"], DefaultSampler, "default") == [
        ChassisNoRepeat
    ]


def test_unknown_name_fails_in_the_front_end_before_the_model_loads(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown logits processor 'nope'; known:"):
        LLM(str(tiny_llama_dir), logits_processors=["nope"], num_kv_blocks=16)


def test_extra_args_must_be_a_dict_with_string_keys():
    assert SamplingParams(extra_args={"a": [1, 2]}).extra_args == {"a": [1, 2]}
    with pytest.raises(ValueError, match="extra_args: must be a dict with string keys"):
        SamplingParams(extra_args=[1])
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={1: 2})
    # values must reach the engine core as msgpack (else a 500 in the front-end)
    for value in (2**64, {"nested": [-(2**63) - 1]}, object()):
        with pytest.raises(ValueError, match="extra_args: must be JSON-like values"):
            SamplingParams(extra_args={"no_repeat_ngram_size": value})


# -- batch updates -----------------------------------------------------------------------------


def _state(request_id: str) -> RequestState:
    return RequestState(request_id, [1, 2], [], SamplingParams(), frozenset(), None)


def test_batch_updates_replay_the_persistent_batch():
    """Random adds and removals on the real ``InputBatch``; a replica kept only from the
    updates always holds the same request in the same row."""
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=6, max_model_len=8, max_blocks_per_req=2)
    batch.updates = BatchUpdateBuilder()
    replica: dict[int, str] = {}
    next_id = 0
    for _step in range(300):
        for _ in range(rng.randint(0, 4)):  # several changes per update, in any order
            if batch.num_reqs and (rng.random() < 0.5 or batch.num_reqs == 6):
                batch.remove(rng.choice(batch.request_ids))
            else:
                batch.add(_state(f"r{next_id}"), [], 0)
                next_id += 1
        update = batch.updates.build(batch.num_reqs)
        if update is None:
            continue
        assert update.batch_size == batch.num_reqs
        for row in update.removed:
            replica.pop(row, None)
        assert not {m.src for m in update.moved} & {m.dst for m in update.moved}
        moving = {m.dst: replica.pop(m.src) for m in update.moved}  # KeyError: unknown src
        replica.update(moving)
        for added in update.added:
            replica[added.row] = next(
                s.request_id for s in batch.states if s.output_token_ids is added.output_token_ids
            )
        assert replica == dict(enumerate(batch.request_ids))
    assert next_id > 100


def test_builder_reports_a_request_added_then_moved_once_at_its_final_row():
    builder = BatchUpdateBuilder()
    params = SamplingParams()
    builder.add(AddedRequest(1, params, [], []))
    builder.remove(0, moved_from=1)  # row 0 left, the new request moved into it
    update = builder.build(1)
    assert update == BatchUpdate(
        1, removed=(0,), moved=(), added=(AddedRequest(0, params, [], []),)
    )
    assert builder.build(1) is None


# -- no_repeat_ngram against transformers ------------------------------------------------------


def _processor() -> ChassisNoRepeat:
    return ChassisNoRepeat(EngineConfig(), torch.device("cpu"), False)


def _rows(n: int, drafts_before=None, drafts=None) -> LogitsRows:
    batch_rows = np.arange(n, dtype=np.int64) if drafts_before is None else np.zeros(n, np.int64)
    return LogitsRows(
        batch_rows,
        torch.from_numpy(batch_rows),
        None if drafts_before is None else np.asarray(drafts_before, dtype=np.int64),
        drafts or {},
    )


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_no_repeat_ngram_equals_transformers(n):
    gen = torch.Generator().manual_seed(n)
    vocab, length, batch = 12, 40, 5
    # few distinct tokens, so that even 5-grams repeat
    input_ids = torch.randint(0, 4, (batch, length), generator=gen)
    scores = torch.randn(batch, vocab, generator=gen)
    expected = NoRepeatNGramLogitsProcessor(n)(input_ids, scores.clone())
    processor = _processor()
    ids = input_ids.tolist()
    outputs: list[list[int]] = []
    added = []
    for row, tokens in enumerate(ids):
        cut = row * 7  # some prompt, some output (the last row: all output but 12)
        output = tokens[cut:]
        outputs.append(output)
        params = SamplingParams(extra_args={"no_repeat_ngram_size": n})
        added.append(AddedRequest(row, params, tokens[:cut], output))
    processor.update_state(BatchUpdate(batch, added=tuple(added)))
    got = processor.apply(scores.clone(), _rows(batch))
    assert torch.equal(got, expected)
    assert torch.isinf(expected).any()
    # tokens appended to the output lists later are seen (the lists are references)
    more = torch.randint(0, 4, (batch, 9), generator=gen)
    for output, new in zip(outputs, more.tolist(), strict=True):
        output.extend(new)
    expected = NoRepeatNGramLogitsProcessor(n)(torch.cat([input_ids, more], 1), scores.clone())
    assert torch.equal(processor.apply(scores.clone(), _rows(batch)), expected)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_rows_after_drafts_see_the_drafts(n):
    """Under speculative decoding a request's row after ``k`` drafts bans what HF bans after
    its tokens plus those drafts."""
    gen = torch.Generator().manual_seed(10 + n)
    vocab = 6
    tokens = torch.randint(0, vocab, (25,), generator=gen).tolist()
    drafts = torch.randint(0, vocab, (4,), generator=gen).tolist()
    scores = torch.randn(5, vocab, generator=gen)
    processor = _processor()
    params = SamplingParams(extra_args={"no_repeat_ngram_size": n})
    processor.update_state(BatchUpdate(1, added=(AddedRequest(0, params, tokens[:5], tokens[5:]),)))
    got = processor.apply(scores.clone(), _rows(5, range(5), {0: drafts}))
    for k in range(5):
        ids = torch.tensor([tokens + drafts[:k]])
        expected = NoRepeatNGramLogitsProcessor(n)(ids, scores[k : k + 1].clone())
        assert torch.equal(got[k : k + 1], expected), k


def test_no_repeat_ngram_validates_its_argument():
    ChassisNoRepeat.validate_params(SamplingParams(extra_args={"no_repeat_ngram_size": 3}))
    ChassisNoRepeat.validate_params(SamplingParams(extra_args={"other": "x"}))
    for bad in ("3", -1, 2.5, True):
        with pytest.raises(ValueError, match="no_repeat_ngram_size"):
            ChassisNoRepeat.validate_params(
                SamplingParams(extra_args={"no_repeat_ngram_size": bad})
            )


# -- engine runs -------------------------------------------------------------------------------


def _engine(model_dir: Path, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        num_kv_blocks=256,
        logits_processors=["no_repeat_ngram", FORCED],
        **kwargs,
    )


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return _engine(tiny_llama_dir, max_num_seqs=3)


def _greedy(max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None
    )


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _repeats(prompt: list[int], output: list[int], n: int) -> int:
    """How many output tokens complete an n-gram that occurred before them."""
    tokens = prompt + output
    return sum(
        tuple(tokens[j - n + 1 : j + 1]) in set(_ngrams(tokens[:j], n))
        for j in range(max(len(prompt), n - 1), len(tokens))
    )


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(llm) -> list[list[int]]:
    return _run(llm, PROMPTS, _greedy())


def test_no_repeat_ngram_in_the_engine_never_repeats(llm, plain):
    tokenizer = llm.tokenizer
    got = _run(llm, PROMPTS, _greedy(no_repeat_ngram_size=2))
    repeated_plain = 0
    for prompt, tokens, plain_tokens in zip(PROMPTS, got, plain, strict=True):
        ids = tokenizer(prompt).input_ids
        assert _repeats(ids, tokens, 2) == 0
        repeated_plain += _repeats(ids, plain_tokens, 2)
    assert repeated_plain  # the tiny model repeats itself, so the processor had work
    assert got != plain


def test_per_request_args_affect_only_their_rows_as_requests_join_and_leave(llm, plain):
    """Seven requests through a batch of three: some forced, some n-gram-free, some plain, of
    different lengths, so rows finish, join and move; each request gets exactly its own
    treatment."""
    kinds = [
        _greedy(9, force_from=100),
        _greedy(24),
        _greedy(5, force_from=300),
        _greedy(24, no_repeat_ngram_size=2),
        _greedy(13, force_from=500),
        _greedy(24),
        _greedy(7, force_from=700),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    alone_ngram = _run(llm, [prompts[3]], _greedy(24, no_repeat_ngram_size=2))[0]
    got = _run(llm, prompts, kinds)
    for i, (params, tokens) in enumerate(zip(kinds, got, strict=True)):
        base = (params.extra_args or {}).get("force_from")
        if base is not None:
            assert tokens == list(range(base, base + params.max_tokens)), i
        elif params.extra_args:
            assert tokens == alone_ngram
        else:
            assert tokens == plain[i % len(PROMPTS)], i
    forced = llm.engine.executor.worker.runner.logits_processors.processors[1]
    assert isinstance(forced, ForcedTokens)
    assert forced.num_moved and forced.num_removed and forced.num_added >= len(kinds)


def test_bad_args_are_refused_at_admission(llm):
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        llm.generate(["hi"], _greedy(no_repeat_ngram_size="x"))
    with pytest.raises(ValueError, match="force_from"):
        llm.generate(["hi"], _greedy(force_from=-2))


def test_async_scheduling_and_speculative_decoding_give_the_same_tokens(tiny_llama_dir, llm):
    params = [
        _greedy(24, no_repeat_ngram_size=3),
        _greedy(24),
        _greedy(11, force_from=40),
        _greedy(24, no_repeat_ngram_size=1),
    ]
    expected = _run(llm, PROMPTS, params)
    async_llm = _engine(tiny_llama_dir, async_scheduling=True)
    assert _run(async_llm, PROMPTS, params) == expected
    del async_llm
    spec = _engine(
        tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    )
    # the forced requests get no drafts (their processor cannot verify them); the n-gram
    # processor verifies drafts
    admitted = [spec.input_processor.process("hi", p, f"x{i}")[0] for i, p in enumerate(params)]
    assert [r.sampling_params.allow_drafts for r in admitted] == [True, True, False, True]
    assert _run(spec, PROMPTS, params) == expected
    ngram_params = [_greedy(40, no_repeat_ngram_size=6)] * 4
    assert _run(spec, PROMPTS, ngram_params) == _run(llm, PROMPTS, ngram_params)
    scheduler = spec.engine.scheduler
    assert scheduler.spec_num_draft_tokens and scheduler.spec_num_accepted_tokens


# -- the API server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            logits_processors=["no_repeat_ngram"],
        )
    )
    with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        yield c
    engine.shutdown_sync()


def test_vllm_xargs_reach_the_processor_through_the_api(client, llm):
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    xargs = {**body, "vllm_xargs": {"no_repeat_ngram_size": 2}}
    got = client.post("/v1/completions", json=xargs).json()["choices"][0]["text"]
    offline = llm.generate([PROMPTS[1]], _greedy(24, no_repeat_ngram_size=2))[0].outputs[0]
    assert got == offline.text
    assert got != plain
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "vllm_xargs": {"no_repeat_ngram_size": 2},
    }
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_vllm_xargs_are_a_400(client, route):
    body = (
        {"prompt": "hi"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    for xargs in (
        {"no_repeat_ngram_size": -3},
        {"no_repeat_ngram_size": "two"},
        {"no_repeat_ngram_size": 10**20},  # valid JSON that msgpack cannot carry
    ):
        response = client.post(route, json={**body, "max_tokens": 2, "vllm_xargs": xargs})
        assert response.status_code == 400
        error = response.json()["error"]
        assert "no_repeat_ngram_size" in error["message"]
        assert error["param"] == "extra_args"
    response = client.post(route, json={**body, "max_tokens": 2, "vllm_xargs": [1]})
    assert response.status_code == 400
