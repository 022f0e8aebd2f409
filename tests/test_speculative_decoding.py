"""Speculative decoding with n-gram drafts (core/speculative.py): the proposer, the accept
rule, the config, and the engine giving exactly the tokens plain decoding gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_speculative import abort_during_a_drafted_step, sample_first_three

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.samplers.default import DefaultSampler
from chassis.core.config import EngineConfig
from chassis.core.request import EngineCoreRequest
from chassis.core.sampling_metadata import SamplingRow, build_sampling_metadata
from chassis.core.speculative import (
    SpeculativeConfig,
    accepted_tokens,
    can_speculate,
    propose_ngram,
)
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}

# -- the pieces ---------------------------------------------------------------------------------


def test_the_longest_ngram_and_its_latest_occurrence_win() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3]
    # "2 3" occurs at 1 and 5; "5 2 3" nowhere earlier: the latest "2 3" (at 5) gives 8, 7, 5
    assert propose_ngram(tokens, 3, 2, 3) == [8, 7, 5]
    assert propose_ngram([4, 1, 2, 3, 6, 0, 2, 3, 6, 7, 1, 2, 3], 2, 2, 3) == [6, 0]  # "1 2 3"
    assert propose_ngram(tokens, 10, 2, 3) == [8, 7, 5, 2, 3]  # up to the end
    assert propose_ngram([1, 2, 3, 4], 3, 2, 3) == []  # nothing repeats
    assert propose_ngram([5, 5], 3, 2, 3) == []  # too short to repeat an n-gram of 2
    assert propose_ngram([5, 5, 5], 2, 1, 1) == [5, 5]  # "5" at 0 is followed by two tokens
    assert propose_ngram(tokens, 0, 2, 3) == []
    # a short period: the latest "7 7" overlaps the suffix; an earlier one gives all 4
    assert propose_ngram([1, 7, 7, 7, 7, 7, 7], 4, 2, 2) == [7, 7, 7, 7]
    assert propose_ngram([3, 4, 3, 4, 3, 4, 3, 4], 4, 2, 2) == [3, 4, 3, 4]


def test_drafts_are_kept_while_the_model_chose_them() -> None:
    assert accepted_tokens([7, 8, 9, 4], [7, 8, 9]) == [7, 8, 9, 4]  # all, plus the bonus
    assert accepted_tokens([7, 5, 9, 4], [7, 8, 9]) == [7, 5]  # stops at the first miss
    assert accepted_tokens([6, 8, 9, 4], [7, 8, 9]) == [6]
    assert accepted_tokens([3], []) == [3]


def test_verifying_by_exact_match_is_rejection_sampling_of_ngram_drafts() -> None:
    """The runner samples a token after the last one and after each draft (independent rows
    of the default sampler) and keeps drafts while they equal the sample before them. For a
    draft x proposed with certainty (q one-hot, as n-gram drafts are), rejection sampling
    accepts x with probability min(1, p(x) / q(x)) = p(x) and otherwise draws from
    max(p - q, 0) normalized, i.e. p without x: the same law. 20,000 seeded trials of one
    request with 2 drafts (temperature 0.8, top-k 4, vocabulary of 6)."""
    vocab, trials = 6, 20000
    params = SamplingParams(temperature=0.8, top_k=4)
    # logits after the last token, after draft 0 and after draft 1
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    scaled = logits / params.temperature
    scaled[scaled < scaled.topk(4, dim=-1).values[:, -1:]] = float("-inf")
    p = scaled.softmax(dim=-1)
    drafts = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a likely and the likeliest
    rows = [SamplingRow(sampling_params=params, prompt_token_ids=[1], output_token_ids=[])]
    metadata = build_sampling_metadata(rows * (3 * trials), "cpu", vocab)
    torch.manual_seed(0)
    sampled = DefaultSampler(EngineConfig())(logits.repeat(trials, 1), metadata)
    outputs = [
        accepted_tokens(s, drafts) for s in sampled.sampled_token_ids.view(trials, 3).tolist()
    ]

    def frequencies(tokens: list[int]) -> torch.Tensor:
        return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)

    # acceptance: p(draft 0), then p(draft 1) after it
    assert abs(sum(len(o) > 1 for o in outputs) / trials - p[0, drafts[0]]) < 0.015
    assert (
        abs(sum(len(o) == 3 for o in outputs) / trials - p[0, drafts[0]] * p[1, drafts[1]]) < 0.015
    )
    # a rejected draft 0 is followed by a token from rejection sampling's residual
    one_hot = torch.nn.functional.one_hot(torch.tensor(drafts[0]), vocab)
    residual = (p[0] - one_hot).clamp(min=0)
    residual /= residual.sum()
    without_draft = p[0] * (1 - one_hot)
    assert torch.allclose(residual, without_draft / without_draft.sum())
    rejected = frequencies([o[0] for o in outputs if len(o) == 1]).float()
    assert (rejected - residual).abs().sum() / 2 < 0.03
    # after an accepted draft 0, the next token (draft 1 or not) is distributed as p after it
    second = frequencies([o[1] for o in outputs if len(o) > 1]).float()
    assert (second - p[1]).abs().sum() / 2 < 0.03


def test_requests_whose_choices_depend_on_more_than_the_logits_get_no_drafts() -> None:
    assert can_speculate(SamplingParams(temperature=0.0), 0)
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9), 0)
    assert can_speculate(SamplingParams(temperature=0.0, seed=3), 0)  # greedy: no draws
    # its stream is rewound to one draw per output token (core/seeded_drafts.py)
    assert can_speculate(SamplingParams(temperature=0.7, seed=3), 0)
    for params in (
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[3]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[3]]),
        SamplingParams(temperature=0.0, structured_outputs={"choice": ["a"]}),
    ):
        assert not can_speculate(params, 0)
    assert not can_speculate(SamplingParams(temperature=0.0, min_tokens=3), 2)
    assert can_speculate(SamplingParams(temperature=0.0, min_tokens=3), 3)


def test_config_errors_name_what_to_change() -> None:
    assert EngineConfig(speculative_config=SPEC).speculative == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=3
    )
    with pytest.raises(ValueError, match="method 'medusa' is not implemented"):
        EngineConfig(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match=r"unknown keys \['draft_model'\]"):
        EngineConfig(speculative_config={"draft_model": "x"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    assert EngineConfig(speculative_config={"prompt_lookup_max": 1}).speculative == (
        SpeculativeConfig(prompt_lookup_max=1, prompt_lookup_min=1)
    )
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):  # JSON true is not 1
        EngineConfig(speculative_config={"prompt_lookup_min": True})
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineConfig(speculative_config=SPEC, async_scheduling=True)
    greedy_drafts = {"model": "d", "draft_sampling": "greedy"}
    assert SpeculativeConfig.from_value(greedy_drafts).draft_sampling == "greedy"
    assert SpeculativeConfig.from_value({"model": "d"}).draft_sampling == "probabilistic"
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        SpeculativeConfig.from_value({"model": "d", "draft_sampling": "top"})
    with pytest.raises(ValueError, match="n-gram drafts are always one-hot"):
        SpeculativeConfig.from_value({**SPEC, "draft_sampling": "greedy"})
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"num_speculative_tokens": 2}']
    )
    assert engine_config_from_args(args).speculative.num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1]"])


# -- the engine ----------------------------------------------------------------------------------

#: prompts whose greedy continuations (tiny random model) repeat earlier n-grams, and some
#: that do not
PROMPTS = [
    "one two three four one two three four one two three",
    "a b c a b c a b c a b c a b",
    "The capital of France is",
    "x y x y x y x y x y x y x y x y x y",
]


def make_llm(model_dir: Path, **engine) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "block_size": 4}
    return LLM(str(model_dir), **{**settings, **engine})


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def speculative(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir, speculative_config=SPEC)


def greedy_ids(llm: LLM, prompts: list[str], **params) -> list[list[int]]:
    sampling = SamplingParams(
        **{"temperature": 0.0, "max_tokens": 48, "ignore_eos": True, **params}
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]


def test_the_same_tokens_as_plain_decoding(plain: LLM, speculative: LLM) -> None:
    before = speculative.engine.scheduler.stats()
    expected = greedy_ids(plain, PROMPTS)
    assert greedy_ids(speculative, PROMPTS) == expected
    assert greedy_ids(speculative, PROMPTS) == expected  # again, over the prefix cache
    stats = speculative.engine.scheduler.stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0 and 0 < accepted <= drafted  # drafts were made, some kept, some not
    assert accepted < drafted
    kv = speculative.engine.kv_cache_manager
    assert not speculative.engine.has_unfinished() and kv.num_free_blocks == 128
    assert not speculative.engine.scheduler._ngram_indexes  # dropped with the requests


def test_limits_and_stops_cut_the_accepted_tokens(plain: LLM, speculative: LLM) -> None:
    """max_tokens is never overshot by a step's drafts; a stop token in the middle of the
    accepted ones ends the output there."""
    for max_tokens in (1, 2, 7):
        assert greedy_ids(speculative, PROMPTS, max_tokens=max_tokens) == greedy_ids(
            plain, PROMPTS, max_tokens=max_tokens
        )
    reference = greedy_ids(plain, PROMPTS[:1])[0]
    stop = reference[9]
    got = greedy_ids(speculative, PROMPTS[:1], stop_token_ids=[stop])[0]
    assert got == reference[: reference.index(stop) + 1]


def test_other_requests_in_the_same_steps_are_unchanged(plain: LLM, speculative: LLM) -> None:
    """Seeded random sampling (drafted too) and logprobs requests (never drafted) share
    steps with drafted ones and give what they give alone: the same tokens, the same top logprobs' ids, ranks and
    text, their values within float32 rounding (a step with drafts has more rows, and the CPU's
    float32 matmul may sum a row in another order at another row count)."""
    random = SamplingParams(temperature=0.9, seed=5, max_tokens=24)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    mixed = speculative.generate(PROMPTS + PROMPTS[:2], [greedy] * 4 + [random, with_logprobs])
    alone = plain.generate(PROMPTS + PROMPTS[:2], [greedy] * 4 + [random, with_logprobs])
    for got, want in zip(mixed, alone, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    got_logprobs, want_logprobs = mixed[-1].outputs[0].logprobs, alone[-1].outputs[0].logprobs
    assert len(got_logprobs) == len(want_logprobs) == 24
    for got_top, want_top in zip(got_logprobs, want_logprobs, strict=True):
        assert got_top.keys() == want_top.keys()
        for token_id, want in want_top.items():
            got = got_top[token_id]
            assert (got.rank, got.decoded_token) == (want.rank, want.decoded_token)
            assert got.logprob == pytest.approx(want.logprob, rel=1e-5, abs=1e-5)


def test_seeded_requests_get_drafts_and_plain_decodings_tokens(
    plain: LLM, speculative: LLM
) -> None:
    """Seeded random requests are drafted; their stream is rewound to one draw per token
    kept, so each gets exactly the tokens plain decoding gives it, in a batch with others
    and alone, however many drafts its steps keep."""
    seeded = [
        SamplingParams(temperature=0.8, top_k=2, max_tokens=40, ignore_eos=True, seed=s)
        for s in range(len(PROMPTS))
    ]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, seeded)]
    before = speculative.engine.scheduler.stats()
    together = [o.outputs[0].token_ids for o in speculative.generate(PROMPTS, seeded)]
    stats = speculative.engine.scheduler.stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted  # drafts kept and rejected: rewinds of both sizes
    assert together == want
    alone = [
        speculative.generate([p], params)[0].outputs[0].token_ids
        for p, params in zip(PROMPTS, seeded, strict=True)
    ]
    assert alone == want


def test_random_sampling_keeps_its_distribution(tiny_llama_dir: Path) -> None:
    """Unseeded random requests are drafted and verified by exact match with what they
    sample: the first three tokens of 400 samples (top-k 2) are distributed as without
    drafts (total variation distance under 0.15; 0.04 when written), and drafts were kept."""
    prompt = "x y x y x y x y x y x y x y x y x y"
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=6, n=400, ignore_eos=True)
    counts = []
    for spec in (None, SPEC):
        llm = make_llm(
            tiny_llama_dir,
            speculative_config=spec,
            num_kv_blocks=2000,
            max_num_seqs=400,
            max_num_batched_tokens=4096,
        )
        first_three, stats = sample_first_three(llm, prompt, params)
        counts.append(first_three)
    assert stats.spec_num_accepted_tokens > 50
    plain, drafted = counts
    distance = sum(abs(plain[k] - drafted[k]) for k in plain.keys() | drafted.keys()) / 800
    assert distance < 0.15, (plain.most_common(5), drafted.most_common(5))


def test_chunked_prefill_and_a_small_token_budget(plain: LLM, tiny_llama_dir: Path) -> None:
    """A budget of 6 tokens: prompts arrive in chunks, and drafts shrink to what is left of
    the budget next to the other requests' tokens."""
    small = make_llm(tiny_llama_dir, speculative_config=SPEC, max_num_batched_tokens=6)
    try:
        assert greedy_ids(small, PROMPTS) == greedy_ids(plain, PROMPTS)
    finally:
        small.shutdown()


def test_a_real_model_copying_text_accepts_most_drafts() -> None:
    """SmolLM2 asked to repeat a text: the same answer, most drafts accepted."""
    text = (
        "All that glitters is not gold. Actions speak louder than words. "
        "Where there is a will, there is a way."
    )
    messages = [[{"role": "user", "content": f"Repeat exactly:\n\n{text}"}]]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    answers = []
    for spec in (None, SPEC):
        # float32: in 16-bit dtypes a verify step may resolve a near-tie differently
        llm = LLM(dtype="float32", max_model_len=512, num_kv_blocks=64, speculative_config=spec)
        answers.append(llm.chat(messages, params)[0].outputs[0].token_ids)
        stats = llm.engine.scheduler.stats()
    assert answers[0] == answers[1]
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 2


def test_a_request_preempted_in_the_step_it_drafts(plain: LLM, tiny_llama_dir: Path) -> None:
    """Priority scheduling, 16 blocks: an urgent request arrives in the step where a running
    one drafts and takes its blocks; the drafted plan is dropped, both outputs are the plain
    ones and every block comes back."""
    prompts = {"a": [11, 12, 13, 14] * 6, "b": [21, 22, 23] * 8}
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = make_llm(
        tiny_llama_dir,
        speculative_config=SPEC,
        scheduler="priority",
        max_model_len=64,
        num_kv_blocks=16,
    )
    try:
        engine, scheduler = llm.engine, llm.engine.scheduler
        engine.add_request(
            EngineCoreRequest(
                request_id="a", prompt_token_ids=prompts["a"], sampling_params=params, priority=1
            )
        )
        got: dict[str, list[int]] = {"a": [], "b": []}
        budget = engine.config.max_num_batched_tokens
        seen = False  # "a" preempted in a step that drafted for it
        while engine.has_unfinished() or scheduler.has_finished_requests():
            a = scheduler.requests.get("a")
            arrives = (
                "b" not in scheduler.requests
                and not got["b"]
                and a is not None
                and a.num_tokens >= 40  # "b" needs more blocks than are free
                and bool(scheduler._drafts(a, budget))  # "a" drafts in this step
            )
            if arrives:
                engine.add_request(
                    EngineCoreRequest(
                        request_id="b",
                        prompt_token_ids=prompts["b"],
                        sampling_params=params,
                        priority=0,
                    )
                )
            for output in engine.step().outputs:
                got[output.request_id] += output.new_token_ids
            if arrives:
                seen = scheduler.num_preemptions == 1 and a in scheduler.waiting
                assert not a.spec_token_ids
                assert "a" not in scheduler._ngram_indexes  # rebuilt when it drafts again
        assert seen, "the drafting request was not preempted in that step"
        for request_id, prompt in prompts.items():
            want = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
            assert got[request_id] == want
        assert engine.kv_cache_manager.num_free_blocks == 16
        assert engine.executor.worker.runner.batch.num_reqs == 0
    finally:
        llm.shutdown()


def test_an_abort_while_a_drafted_step_runs_frees_everything(tiny_llama_dir: Path) -> None:
    """A request aborted between the plan that drafts for it and that plan's results: the
    results are dropped, the other request goes on, no block or batch row is left behind."""
    llm = make_llm(tiny_llama_dir, speculative_config=SPEC, num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        assert abort_during_a_drafted_step(llm, params) == 40
        assert llm.engine.kv_cache_manager.num_free_blocks == 64
        assert not llm.engine.scheduler._ngram_indexes
        assert llm.engine.executor.worker.runner.batch.num_reqs == 0
    finally:
        llm.shutdown()


def test_memory_profiling_computes_logits_for_every_draft_row(tiny_llama_dir: Path) -> None:
    """The start-up profile sizes the KV cache after a forward whose logits have as many rows
    as a step can sample: with drafts, 1 + num_speculative_tokens per request."""
    llm = make_llm(
        tiny_llama_dir, speculative_config=SPEC, max_num_seqs=2, max_num_batched_tokens=64
    )
    try:
        runner = llm.engine.executor.worker.runner
        rows = []
        compute_logits = runner.model.compute_logits
        runner.model.compute_logits = lambda hidden: (
            rows.append(len(hidden)) or compute_logits(hidden)
        )
        runner.profile_run(64)
        assert rows == [2 * (1 + SPEC["num_speculative_tokens"])]
    finally:
        llm.shutdown()
