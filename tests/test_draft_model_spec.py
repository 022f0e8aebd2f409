"""Speculative decoding with a draft model (core/draft_model.py, ``--speculative-config``
``{"model": ..., "num_speculative_tokens": k}``): the output is plain decoding's whatever the
draft proposes, a perfect draft cuts the steps by about k + 1, and preemption, aborts and
prefix caching keep every block accounted for.

Drafts: the target itself (every draft accepted), the target with slightly perturbed
weights (some accepted, some not) and a model of another seed (almost none accepted)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from fixtures_models import hf_greedy_tokens, write_tiny_checkpoint
from fixtures_speculative import abort_during_a_drafted_step, counting_steps, sample_first_three
from fixtures_tensor_memory import PeakTensorBytes
from safetensors.torch import load_file, save_file
from spec_decode_helpers import PROMPTS
from transformers import AutoConfig, AutoModelForCausalLM

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.samplers.default import DefaultSampler
from chassis.core.config import EngineConfig
from chassis.core.request import EngineCoreRequest
from chassis.core.tokenizer import load_tokenizer
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser

K = 4


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama like the target but of another seed: its drafts are almost all wrong."""
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft_seed1"), seed=1)


@pytest.fixture(scope="module")
def perturbed_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's weights plus noise of 0.003 (theirs are ~0.1): about half its drafts
    are accepted, so verify steps keep some drafts and reject others."""
    directory = tmp_path_factory.mktemp("draft_perturbed")
    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, directory / path.name)
    weights = load_file(tiny_llama_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.003 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    save_file(noisy, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def make_llm(model_dir: Path, draft: Path | None = None, **engine) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "block_size": 4}
    if draft is not None:
        settings["speculative_config"] = {"model": str(draft), "num_speculative_tokens": K}
    return LLM(str(model_dir), **{**settings, **engine})


def greedy(max_tokens: int = 24, **params) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)


def token_ids(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_all_freed(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    if engine.scheduler.has_finished_requests():
        engine.step()  # lets the runner drop the last finished requests
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.scheduler._draft_proposals  # dropped with their requests
    assert engine.executor.worker.runner.batch.num_reqs == 0


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def expected(plain: LLM, tiny_llama_dir: Path) -> list[list[int]]:
    """Plain greedy decoding's tokens, checked against HF's."""
    tokens = token_ids(plain, PROMPTS, greedy())
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    assert tokens == hf_greedy_tokens(hf, load_tokenizer(tiny_llama_dir), PROMPTS, 24)
    return tokens


# -- greedy parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["perturbed", "other_seed", "target"])
def test_greedy_output_is_plain_decoding(
    draft: str, tiny_llama_dir: Path, expected: list[list[int]], request: pytest.FixtureRequest
) -> None:
    """Prompts of 4 to 40 tokens with chunked prefill (a budget of 16 tokens, so prompts
    arrive in chunks and drafts shrink to what the budget leaves), prefix caching on: the
    same tokens as plain decoding and HF, twice (the second time over cached prefixes,
    whose blocks carry the draft's K/V too)."""
    draft_dir = tiny_llama_dir if draft == "target" else request.getfixturevalue(f"{draft}_dir")
    llm = make_llm(tiny_llama_dir, draft_dir, max_num_batched_tokens=16)
    try:
        assert token_ids(llm, PROMPTS, greedy()) == expected
        assert token_ids(llm, PROMPTS, greedy()) == expected
        stats = llm.engine.scheduler.stats()
        assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        assert drafted > 0
        if draft == "perturbed":
            assert 0 < accepted < drafted  # verify steps both keep and reject drafts
        if draft == "target":
            assert accepted == drafted
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_the_drafts_are_the_draft_models_own_greedy_continuation(
    tiny_llama_dir: Path, perturbed_dir: Path
) -> None:
    """After every step, each request's proposal is what the draft model alone writes
    greedily after the request's tokens: its K/V (filled chunk by chunk, kept across
    rejected drafts, shared through the prefix cache) are right. Two requests sharing a
    prefix, a 12-token budget (chunked prompts)."""
    llm = make_llm(tiny_llama_dir, perturbed_dir, max_num_batched_tokens=12)
    reference = make_llm(perturbed_dir)
    try:
        engine, scheduler = llm.engine, llm.engine.scheduler
        prompt = list(range(100, 130))
        prompts = {"a": prompt, "b": [*prompt[:20], 7, 8, 9]}  # "b" arrives later

        def add(request_id: str) -> None:
            engine.add_request(
                EngineCoreRequest(
                    request_id=request_id,
                    prompt_token_ids=prompts[request_id],
                    sampling_params=greedy(20),
                )
            )

        add("a")
        checked = 0
        prompts_added = {"a"}
        while engine.has_unfinished():
            plan = scheduler.schedule()
            result = engine.executor.execute_model_async(plan).result()
            scheduler.update_from_output(plan, result)
            if "a" in result.draft_token_ids and "b" not in prompts_added:
                add("b")  # over a's cached first 20 tokens
                prompts_added.add("b")
            for request_id, drafts in result.draft_token_ids.items():
                request = scheduler.requests.get(request_id)
                if request is None:
                    continue  # finished by this step
                tokens = request.prompt_token_ids + request.output_token_ids
                own = reference.generate({"prompt_token_ids": tokens}, greedy(len(drafts)))
                assert drafts == own[0].outputs[0].token_ids
                checked += 1
        assert checked >= 6
        assert engine.kv_cache_manager.prefix_cache_hits == 20
        assert (
            0 < scheduler.stats().spec_num_accepted_tokens < scheduler.stats().spec_num_draft_tokens
        )
        assert_all_freed(llm)
    finally:
        llm.shutdown()
        reference.shutdown()


def test_target_as_draft_accepts_everything_in_k_plus_1_fewer_steps(
    tiny_llama_dir: Path, plain: LLM, expected: list[list[int]]
) -> None:
    """The target drafting for itself: every draft is accepted (float32), so each step after
    the prefill yields k + 1 tokens, and the steps drop from 1 + (n - 1) to
    1 + ceil((n - 1) / (k + 1))."""
    max_tokens = 41
    prompt = PROMPTS[2]
    llm = make_llm(tiny_llama_dir, tiny_llama_dir)
    try:
        with counting_steps(plain) as plain_steps, counting_steps(llm) as draft_steps:
            want = token_ids(plain, [prompt], greedy(max_tokens))
            assert token_ids(llm, [prompt], greedy(max_tokens)) == want
        assert want[0][:24] == expected[2]
        stats = llm.engine.scheduler.stats()
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert plain_steps[0] == max_tokens
        assert draft_steps[0] == 1 + math.ceil((max_tokens - 1) / (K + 1))
        # every token after the prefill's is an accepted draft or a verify step's own
        assert stats.spec_num_accepted_tokens + draft_steps[0] - 1 == max_tokens - 1
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_max_tokens_and_stop_tokens_cut_the_drafts(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM, expected: list[list[int]]
) -> None:
    llm = make_llm(tiny_llama_dir, perturbed_dir)
    try:
        for max_tokens in (1, 2, 6):
            assert token_ids(llm, PROMPTS, greedy(max_tokens)) == [e[:max_tokens] for e in expected]
        stop = expected[1][9]
        got = token_ids(llm, PROMPTS[1:2], greedy(stop_token_ids=[stop]))[0]
        assert got == expected[1][: expected[1].index(stop) + 1]
        assert_all_freed(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", ["target", "perturbed"])
def test_the_context_limit_cuts_the_drafts(
    draft: str, tiny_llama_dir: Path, request: pytest.FixtureRequest
) -> None:
    """--max-model-len 48 and no max_tokens: requests run into the context limit, which
    neither drafts nor the draft's lookahead slots may pass; the outputs are plain
    decoding's, ending at 48 tokens."""
    draft_dir = tiny_llama_dir if draft == "target" else request.getfixturevalue(f"{draft}_dir")
    prompts = [{"prompt_token_ids": list(range(200, 200 + n))} for n in (20, 37, 45, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    plain = make_llm(tiny_llama_dir, max_model_len=48)
    llm = make_llm(tiny_llama_dir, draft_dir, max_model_len=48)
    try:
        want = token_ids(plain, prompts, params)
        assert [len(w) for w in want] == [28, 11, 3, 1]  # up to the 48 tokens of context
        assert token_ids(llm, prompts, params) == want
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
        assert_all_freed(llm)
    finally:
        plain.shutdown()
        llm.shutdown()


# -- random sampling -----------------------------------------------------------------------------


def test_unseeded_random_sampling_runs_and_stops(tiny_llama_dir: Path) -> None:
    """Sampled requests (no seed) draft and verify by exact match: they run, keep some
    drafts, stop at max_tokens and at a stop token (only at their end)."""
    llm = make_llm(tiny_llama_dir, tiny_llama_dir)
    try:
        params = SamplingParams(temperature=1.0, top_k=3, max_tokens=20, ignore_eos=True, n=4)
        outputs = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
        assert all(len(c.token_ids) == 20 for c in outputs)
        stats = llm.engine.scheduler.stats()
        assert stats.spec_num_accepted_tokens > 0
        # a token the samples often write, as a stop token
        counts: dict[int, int] = {}
        for c in outputs:
            for t in c.token_ids:
                counts[t] = counts.get(t, 0) + 1
        stop = max(counts, key=counts.__getitem__)
        params = SamplingParams(
            temperature=1.0, top_k=3, max_tokens=20, ignore_eos=True, n=4, stop_token_ids=[stop]
        )
        stopped = 0
        for c in (c for o in llm.generate(PROMPTS, params) for c in o.outputs):
            assert stop not in c.token_ids[:-1]
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == stop
                stopped += 1
            else:
                assert len(c.token_ids) == 20
        assert stopped > 0
        assert_all_freed(llm)
    finally:
        llm.shutdown()


# -- probabilistic drafts (rejection sampling) ---------------------------------------------------


def sampling_llm(model_dir: Path, draft: Path, draft_sampling: str, **engine) -> LLM:
    spec = {"model": str(draft), "num_speculative_tokens": K, "draft_sampling": draft_sampling}
    return make_llm(model_dir, speculative_config=spec, **engine)


def test_target_as_probabilistic_draft_accepts_every_draft(tiny_llama_dir: Path) -> None:
    """Temperature 1, the target drafting for itself: the draft's q is the target's p, so
    rejection sampling accepts every draft (min(1, p/q) = 1) and each step after the
    prefill yields k + 1 tokens. Greedy (one-hot) drafts of the same model are accepted
    only when the sample hits the argmax, a small share for this near-uniform random model."""
    params = SamplingParams(temperature=1.0, max_tokens=21, ignore_eos=True, n=2)
    shares = {}
    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    for draft_sampling in ("probabilistic", "greedy"):
        llm = sampling_llm(tiny_llama_dir, tiny_llama_dir, draft_sampling)
        try:
            with counting_steps(llm) as steps:
                outputs = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
            assert all(len(c.token_ids) == 21 for c in outputs)
            assert all(0 <= t < vocab for c in outputs for t in c.token_ids)
            stats = llm.engine.scheduler.stats()
            assert stats.spec_num_draft_tokens > 0
            shares[draft_sampling] = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
            if draft_sampling == "probabilistic":
                assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
                assert steps[0] == 1 + math.ceil(20 / (K + 1))  # all requests in step
            assert_all_freed(llm)
        finally:
            llm.shutdown()
    assert shares["probabilistic"] == 1.0
    assert shares["greedy"] < 0.5


def test_probabilistic_drafts_keep_the_distribution(
    tiny_llama_dir: Path, perturbed_dir: Path
) -> None:
    """A perturbed draft (q near p, not equal): drafts are accepted and rejected, and the
    first three tokens of 400 samples (temperature 1, top-k 2) are distributed as without
    drafts (total variation distance under 0.15, as the n-gram test in
    test_speculative_decoding.py)."""
    prompt = "x y x y x y x y x y x y x y x y x y"
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=6, n=400, ignore_eos=True)
    engine = {"num_kv_blocks": 2000, "max_num_seqs": 400, "max_num_batched_tokens": 4096}
    counts = []
    for drafted in (False, True):
        llm = (
            sampling_llm(tiny_llama_dir, perturbed_dir, "probabilistic", **engine)
            if drafted
            else make_llm(tiny_llama_dir, **engine)
        )
        first_three, stats = sample_first_three(llm, prompt, params)
        counts.append(first_three)
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    plain, drafted_counts = counts
    keys = plain.keys() | drafted_counts.keys()
    distance = sum(abs(plain[k] - drafted_counts[k]) for k in keys) / 800
    assert distance < 0.15, (plain.most_common(5), drafted_counts.most_common(5))


def test_the_memory_profile_holds_the_verify_steps_tensors(tiny_llama_dir: Path) -> None:
    """The start-up profile (``ModelRunner.profile_run``) runs rejection sampling for real
    while the step's logits are alive: with probabilistic drafts its peak of tensor memory
    grows, over greedy drafts', by the kept ``q`` (``max_num_seqs * k`` rows) plus the
    verify step's 7 temporaries of ``max_num_seqs * (k + 1)`` rows (the rows' logits copy,
    their ``q``, ``p``, ``q`` masked on bonus rows, the residual, the noise and the race's
    quotients), vocabulary-wide float32 each, within one row (the ids, uniforms and masks)."""
    llm = sampling_llm(
        tiny_llama_dir, tiny_llama_dir, "probabilistic", max_num_seqs=2, max_num_batched_tokens=64
    )
    try:
        runner = llm.engine.executor.worker.runner
        sampler = DefaultSampler(llm.engine.config)
        peaks = {}
        for probabilistic in (True, False):
            # custom logits processors turn probabilistic drafts off
            assert runner.drafter.use_sampler(sampler, not probabilistic) == probabilistic
            with PeakTensorBytes() as memory:
                runner.profile_run(64)
            assert memory.current == 0  # the profile keeps nothing
            peaks[probabilistic] = memory.peak
        row = runner.drafter.vocab_size * 4
        want = (2 * K + 7 * 2 * (K + 1)) * row
        assert abs(peaks[True] - peaks[False] - want) < row, (peaks, want)
    finally:
        llm.shutdown()


def test_a_sampler_without_probabilities_gets_one_hot_drafts(tiny_llama_dir: Path) -> None:
    """A sampler that does not provide probabilities (a plugin's, or a ``DefaultSampler``
    subclass that draws its own way) or custom logits processors: greedy drafts verified by
    exact match, so with the target as its own draft few drafts are accepted at
    temperature 1 (all of them with the default sampler, test above)."""

    class OwnDraw(DefaultSampler):
        def sample(self, logits: torch.Tensor, metadata) -> torch.Tensor:
            return super().sample(logits, metadata)

    llm = sampling_llm(tiny_llama_dir, tiny_llama_dir, "probabilistic")
    try:
        drafter = llm.engine.executor.worker.runner.drafter
        default = DefaultSampler(llm.engine.config)
        assert not drafter.use_sampler(default, has_logits_processors=True)
        assert not drafter.use_sampler(OwnDraw(llm.engine.config), has_logits_processors=False)
        params = SamplingParams(temperature=1.0, max_tokens=21, ignore_eos=True)
        assert all(len(t) == 21 for t in token_ids(llm, PROMPTS, params))
        stats = llm.engine.scheduler.stats()
        assert stats.spec_num_draft_tokens > 0
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 2
        assert drafter.use_sampler(default, has_logits_processors=False)
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_probabilistic_drafts_are_reproducible_under_seed(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM
) -> None:
    """The engine's ``seed`` fixes the global stream the draft's draws and the rejection
    step use: two engines give the same sampled outputs."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = sampling_llm(tiny_llama_dir, perturbed_dir, "probabilistic", seed=7)
        try:
            runs.append(token_ids(llm, PROMPTS, params))
            assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
            assert_all_freed(llm)
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


def test_seeded_requests_get_drafts_and_plain_decodings_tokens(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM
) -> None:
    """A request with its own ``seed`` gets the draft's argmax as drafts, verified by exact
    match from its own stream, which is then rewound to one draw per token kept
    (core/seeded_drafts.py): it is drafted, and gets the tokens plain seeded decoding gives
    it, in two engines of other engine seeds, in a batch with unseeded random requests
    (whose drafts are probabilistic and whose draws use the global stream) and alone."""
    seeded = [
        SamplingParams(temperature=0.8, top_k=2, max_tokens=24, ignore_eos=True, seed=s)
        for s in range(len(PROMPTS))
    ]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, seeded)]
    for engine_seed in (3, 4):
        llm = sampling_llm(tiny_llama_dir, perturbed_dir, "probabilistic", seed=engine_seed)
        try:
            outputs = llm.generate(PROMPTS * 2, seeded + [unseeded] * len(PROMPTS))
            assert [o.outputs[0].token_ids for o in outputs[: len(PROMPTS)]] == want
            stats = llm.engine.scheduler.stats()
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
            before = stats.spec_num_draft_tokens
            alone = [
                token_ids(llm, [prompt], params)[0]
                for prompt, params in zip(PROMPTS, seeded, strict=True)
            ]
            assert alone == want
            assert llm.engine.scheduler.stats().spec_num_draft_tokens > before  # drafted
            assert_all_freed(llm)
            assert not llm.engine.executor.worker.runner.drafter._draft_probs
        finally:
            llm.shutdown()


def test_greedy_random_and_seeded_requests_share_probabilistic_steps(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM, expected: list[list[int]]
) -> None:
    """Greedy, unseeded random (top-p, min-p) and seeded random requests in the same steps,
    a perturbed draft (drafts accepted and rejected): the greedy rows keep plain greedy
    decoding's tokens and the seeded ones plain seeded decoding's, although the random
    rows between them are replaced by rejection sampling's."""
    n = len(PROMPTS)
    random = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    prompts = [p for p in PROMPTS for _ in range(3)]
    params = [greedy(), random, seeded] * n
    want_seeded = token_ids(plain, PROMPTS, seeded)
    llm = sampling_llm(tiny_llama_dir, perturbed_dir, "probabilistic")
    try:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        assert outputs[0::3] == expected
        assert outputs[2::3] == want_seeded
        assert all(len(t) == 24 for t in outputs[1::3])
        assert_all_freed(llm)
        assert not llm.engine.executor.worker.runner.drafter._draft_probs
    finally:
        llm.shutdown()


# -- preemption and aborts -----------------------------------------------------------------------


def test_preemption_with_a_tiny_kv_cache(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM
) -> None:
    """24 blocks of 4 tokens for four requests of up to 40 + 30 tokens: requests are
    preempted (their draft lookahead too) and resumed; outputs are plain decoding's and
    every block comes back."""
    params = greedy(30)
    want = token_ids(plain, PROMPTS, params)
    llm = make_llm(tiny_llama_dir, perturbed_dir, num_kv_blocks=24, max_model_len=96)
    try:
        assert token_ids(llm, PROMPTS, params) == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_seeded_requests_preempted_mid_speculation(
    tiny_llama_dir: Path, perturbed_dir: Path, plain: LLM
) -> None:
    """Seeded random requests with drafts, preempted and resumed in a tiny KV cache: the
    resumed stream continues at one draw per output token, so the tokens are still plain
    seeded decoding's."""
    params = [
        SamplingParams(temperature=0.8, top_k=2, max_tokens=30, ignore_eos=True, seed=s)
        for s in range(len(PROMPTS))
    ]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    llm = sampling_llm(
        tiny_llama_dir, perturbed_dir, "probabilistic", num_kv_blocks=24, max_model_len=96
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_preemption_mid_speculation_with_probabilistic_drafts(tiny_llama_dir: Path) -> None:
    """Random requests (temperature 1) preempted and resumed in a tiny KV cache, the target
    as its own probabilistic draft: every draft is still verified against the q it was
    drawn from (a stale or misplaced q would reject some), and nothing is left behind."""
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    llm = sampling_llm(
        tiny_llama_dir, tiny_llama_dir, "probabilistic", num_kv_blocks=24, max_model_len=96
    )
    try:
        assert all(len(t) == 30 for t in token_ids(llm, PROMPTS, params))
        stats = llm.engine.scheduler.stats()
        assert llm.engine.scheduler.num_preemptions > 0
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert_all_freed(llm)
        assert not llm.engine.executor.worker.runner.drafter._draft_probs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", [None, 5])
def test_an_abort_between_a_drafted_plan_and_its_results(
    tiny_llama_dir: Path, perturbed_dir: Path, seed: int | None
) -> None:
    """A request aborted while the step that verifies its drafts runs: its results and
    proposals are dropped, the other request goes on, nothing is left behind. Seeded random
    requests too (the aborted one's stream is rewound at the step's results, then dropped)."""
    llm = make_llm(tiny_llama_dir, perturbed_dir, num_kv_blocks=64)
    if seed is None:
        params = greedy(40)
    else:
        params = SamplingParams(temperature=0.8, top_k=2, max_tokens=40, ignore_eos=True, seed=seed)
    try:
        assert abort_during_a_drafted_step(llm, params) == 40
        assert_all_freed(llm)
    finally:
        llm.shutdown()


def test_lora_requests_get_drafts_from_the_base_draft(
    tiny_llama_dir: Path, perturbed_dir: Path, tmp_path: Path
) -> None:
    """With --enable-lora the draft runs without adapters (its K/V do not depend on them);
    an adapter's requests verify its drafts with the adapter and give what they give
    without drafts, next to base requests in the same steps."""
    from fixtures_lora import write_peft_adapter

    from chassis.core.lora import LoRARequest

    adapter = LoRARequest("a", 1, str(write_peft_adapter(tmp_path / "a", tiny_llama_dir)))
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[3], PROMPTS[3]]
    loras = [adapter, None, adapter, None]
    outputs = []
    for draft in (None, perturbed_dir):
        llm = make_llm(tiny_llama_dir, draft, enable_lora=True, max_loras=1)
        try:
            results = llm.generate(prompts, greedy(), lora_request=loras)
            outputs.append([o.outputs[0].token_ids for o in results])
            if draft is not None:
                assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
                assert_all_freed(llm)
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]  # the adapter changes the output


# -- memory and configuration --------------------------------------------------------------------


def test_a_kv_block_holds_the_drafts_layers_too(
    tiny_llama_dir: Path, plain: LLM, expected: list[list[int]], tmp_path: Path
) -> None:
    """The draft's caches use the target's block ids: one tensor per draft layer with the
    target's block count, and a block's bytes (what the block count is sized by) are the
    target's plus the draft's. A draft of another architecture and shape (a 1-layer Qwen3,
    head_dim 32 where the target has 16) drafts for the target all the same."""
    draft_dir = write_tiny_checkpoint("qwen3", tmp_path / "qwen3", num_hidden_layers=1)
    llm = make_llm(tiny_llama_dir, draft_dir)
    try:
        runner = llm.engine.executor.worker.runner
        target_bytes = plain.engine.executor.worker.runner.kv_cache_bytes_per_block()
        draft_bytes = 1 * 2 * 4 * 2 * 32 * 4  # layers, K and V, block size, KV heads, dim, fp32
        assert runner.drafter.kv_cache_bytes_per_block() == draft_bytes
        assert runner.kv_cache_bytes_per_block() == target_bytes + draft_bytes
        assert [c.shape for c in runner.drafter.kv_caches] == [(128, 2, 4, 2, 32)]
        assert token_ids(llm, PROMPTS, greedy()) == expected
        assert llm.engine.scheduler.stats().spec_num_draft_tokens > 0
        assert_all_freed(llm)
    finally:
        llm.shutdown()
    # sized from memory: the blocks that fit the budget at the larger block size
    budget = 100 * (target_bytes + draft_bytes) + 17
    llm = make_llm(tiny_llama_dir, draft_dir, num_kv_blocks=None, kv_cache_memory=budget)
    try:
        assert llm.engine.info.num_kv_blocks == 100
    finally:
        llm.shutdown()


def test_configuration_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    spec = {"model": str(tiny_llama_dir)}
    assert EngineConfig(speculative_config=spec).speculative.method == "draft_model"
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"model": "m", "num_speculative_tokens": 3}']
    )
    parsed = engine_config_from_args(args).speculative
    assert (parsed.method, parsed.model, parsed.num_speculative_tokens) == ("draft_model", "m", 3)
    with pytest.raises(ValueError, match="method 'medusa' is not implemented"):
        EngineConfig(speculative_config={"method": "medusa", "model": "m"})
    with pytest.raises(ValueError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="takes no model"):
        EngineConfig(speculative_config={"method": "ngram", "model": "m"})
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineConfig(speculative_config=spec, async_scheduling=True)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--runner pooling"):
        EngineConfig(speculative_config=spec, runner="pooling")
    small_vocab = write_tiny_checkpoint("llama", tmp_path / "vocab", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens and the target 49152"):
        make_llm(tiny_llama_dir, small_vocab)
    short = write_tiny_checkpoint("llama", tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match="shorter than --max-model-len 256"):
        make_llm(tiny_llama_dir, short)
