"""Beam search (vLLM's ``LLM.beam_search`` and the server's ``use_beam_search``).

What is checked, and against what:

- The algorithm (:class:`BeamSearch`) on a toy model, against exhaustive search: when the
  beam width covers every prefix (``k >= (V-1)**(T-1)`` with EOS, ``k >= V**(T-1)`` without),
  beam search must return exactly the best ``k`` of all sequences under vLLM's score.
- The engine path on a tiny random checkpoint (float32): ``beam_width=1`` is greedy; with
  EOS out of the picture (``ignore_eos`` / an EOS never proposed) the beams, their order and
  their scores are HF transformers' ``generate(num_beams=k, do_sample=False)``; on a 6- and
  4-token vocabulary the engine's search equals exhaustive search over HF's logprobs, EOS
  and length penalties included (where HF's own beam search ranks finished beams by another
  length, see docs/sampling.md).
- ``AsyncLLM.beam_search`` and the two API routes return what ``LLM.beam_search`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from transformers import AutoModelForCausalLM, LlamaConfig

from chassis import LLM, SamplingParams
from chassis.core.async_llm import AsyncLLM
from chassis.core.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_search_score,
    run_beam_search,
    step_logprobs,
    step_sampling_params,
)
from chassis.core.config import EngineConfig
from chassis.core.outputs import Logprob
from chassis.core.tokenizer import load_tokenizer
from chassis.serve.app import build_app, get_state
from chassis.serve.beam_search import to_request_output
from chassis.serve.settings import ServerSettings

EOS = 2  # TINY_CONFIG_FIELDS' eos_token_id

# -- the algorithm on a toy model -------------------------------------------------------------


def toy_logprobs(tokens: list[int], vocab: int) -> list[float]:
    """A fixed, arbitrary next-token distribution for every sequence."""
    rng = random.Random(str(tokens))
    logits = [rng.gauss(0.0, 1.5) for _ in range(vocab)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def position(logprobs: list[float], num: int) -> dict[int, Logprob]:
    """What the engine returns at temperature 0: the ``num`` best tokens, by rank."""
    ranked = sorted(range(len(logprobs)), key=lambda t: -logprobs[t])[:num]
    return {t: Logprob(logprobs[t], rank) for rank, t in enumerate(ranked, start=1)}


def toy_search(
    prompts: list[list[int]], params: BeamSearchParams, vocab: int
) -> list[BeamSearchOutput]:
    num = step_sampling_params(params, vocab, 20).logprobs or 0

    def step(beams):
        return [position(toy_logprobs(b.token_ids, vocab), num) for b in beams]

    return run_beam_search(BeamSearch(prompts, params, [EOS]), step)


def exhaustive(
    prompt: list[int],
    logprobs_of,
    vocab: int,
    params: BeamSearchParams,
) -> list[tuple[tuple[int, ...], float]]:
    """Every sequence beam search may return (ends on EOS, or has ``max_tokens`` tokens),
    the best ``beam_width`` by vLLM's score, with their cumulative logprobs."""
    scored = []
    for length in range(1, params.max_tokens + 1):
        for generated in itertools.product(range(vocab), repeat=length):
            ends = generated[-1] == EOS and not params.ignore_eos
            if not params.ignore_eos and EOS in generated[:-1]:
                continue  # EOS would have ended it earlier
            if length < params.max_tokens and not ends:
                continue
            cum = sum(
                logprobs_of(prompt + list(generated[:i]))[token]
                for i, token in enumerate(generated)
            )
            counted = len(prompt) + length - (1 if ends else 0)
            scored.append((generated, cum, beam_search_score(cum, counted, params.length_penalty)))
    scored.sort(key=lambda item: -item[2])
    return [(tokens, cum) for tokens, cum, _ in scored[: params.beam_width]]


def returned(output: BeamSearchOutput) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(s.output_token_ids), s.cum_logprob) for s in output.sequences]


def assert_same(got, expected, tol=1e-9):
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=tol)


@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0, -1.0])
@pytest.mark.parametrize(
    ("vocab", "max_tokens", "beam_width", "ignore_eos"),
    [(5, 2, 4, False), (4, 3, 9, False), (4, 2, 4, True), (3, 3, 9, True)],
)
def test_wide_enough_beams_are_exhaustive_search(
    vocab, max_tokens, beam_width, ignore_eos, length_penalty
):
    params = BeamSearchParams(
        beam_width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty
    )
    prompts = [[1, 3], [4, 0, 3, 1]]
    outputs = toy_search(prompts, params, vocab)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = exhaustive(prompt, lambda t: toy_logprobs(t, vocab), vocab, params)
        assert_same(returned(output), expected)


def test_beam_width_one_is_greedy_decoding():
    vocab = 50
    tokens = [7, 8]
    for _ in range(12):
        logprobs = toy_logprobs(tokens, vocab)
        tokens.append(max(range(vocab), key=lambda t: logprobs[t]))
    [output] = toy_search([[7, 8]], BeamSearchParams(1, 12, ignore_eos=True), vocab)
    assert output.sequences[0].tokens == tokens


def scripted(table: dict[tuple[int, ...], dict[int, float]]):
    """A step function reading each beam's next-token logprobs from ``table``."""

    def step(beams):
        out = []
        for beam in beams:
            row = table[tuple(beam.token_ids)]
            ranked = sorted(row, key=lambda t: -row[t])
            out.append({t: Logprob(row[t], r) for r, t in enumerate(ranked, start=1)})
        return out

    return step


def test_finished_beams_are_kept_aside_and_scored_with_the_prompt_length():
    """A beam ending on EOS is finished at once (any rank), never extended, and scored by
    ``cum / (prompt + generated - EOS) ** length_penalty``: here it beats a live beam that
    HF's length (generated tokens, EOS counted) would rank first."""
    prompt = (10, 11, 12)
    table = {
        prompt: {20: -0.3, 21: -0.35, EOS: -0.5},  # EOS ranks last of what is returned
        (*prompt, 20): {30: -0.6, 31: -3.0},
        (*prompt, 21): {32: -2.0, 33: -3.0},
    }
    search = BeamSearch([list(prompt)], BeamSearchParams(2, 2, length_penalty=1.0), [EOS])
    [output] = run_beam_search(search, scripted(table))
    best, second = output.sequences
    assert best.tokens == [*prompt, EOS] and best.finish_reason == "stop"
    assert best.stop_reason == EOS and best.output_token_ids == [EOS]
    assert best.cum_logprob == pytest.approx(-0.5)
    assert best.score(1.0) == pytest.approx(-0.5 / 3)  # 3 prompt tokens, EOS not counted
    assert second.output_token_ids == [20, 30] and second.finish_reason == "length"
    assert second.score(1.0) == pytest.approx(-0.9 / 5)
    # HF's length (generated tokens with EOS): -0.5 / 1 < -0.9 / 2, the other order
    assert -0.5 / 1 < -0.9 / 2
    assert len(second.logprobs) == 2 and second.logprobs[0] == {
        20: Logprob(-0.3, 1),
        21: Logprob(-0.35, 2),
        EOS: Logprob(-0.5, 3),
    }


def test_eos_is_an_ordinary_token_with_ignore_eos():
    prompt = (10,)
    table = {prompt: {EOS: -0.1, 20: -2.0}, (*prompt, EOS): {21: -0.2, 22: -0.3}}
    search = BeamSearch([list(prompt)], BeamSearchParams(1, 2, ignore_eos=True), [EOS])
    [output] = run_beam_search(search, scripted(table))
    [sequence] = output.sequences
    assert sequence.output_token_ids == [EOS, 21] and sequence.finish_reason == "length"


def test_search_ends_when_every_beam_has_finished():
    prompt = (10,)
    table = {prompt: {EOS: -0.1, 3: -0.2}, (*prompt, 3): {EOS: -0.3}}
    steps = []

    def step(beams):
        steps.append(len(beams))
        return scripted(table)(beams)

    search = BeamSearch([list(prompt)], BeamSearchParams(1, 50), [EOS])
    [output] = run_beam_search(search, step)
    assert steps == [1, 1]  # no third step: nothing live
    assert [s.output_token_ids for s in output.sequences] == [[EOS]]


def test_an_aborted_step_ends_that_prompt_only():
    search = BeamSearch([[5], [6]], BeamSearchParams(2, 3, ignore_eos=True), [EOS])
    calls = 0

    def step(beams):
        nonlocal calls
        calls += 1
        results = [position(toy_logprobs(b.token_ids, 8), 4) for b in beams]
        if calls == 2:  # prompt 0's beams are aborted in the second step
            results = [
                None if b.prompt_index == 0 else r for b, r in zip(beams, results, strict=True)
            ]
        return results

    first, second = run_beam_search(search, step)
    assert {s.finish_reason for s in first.sequences} == {"abort"}
    assert all(len(s.output_token_ids) == 1 for s in first.sequences)
    assert {s.finish_reason for s in second.sequences} == {"length"}
    assert all(len(s.output_token_ids) == 3 for s in second.sequences)
    with pytest.raises(ValueError, match="step results"):
        BeamSearch([[5]], BeamSearchParams(2, 3), [EOS]).advance([])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"invalid beam search parameter {field}"):
        BeamSearchParams(**kwargs)


def test_step_requests_ask_for_twice_the_beam_width_of_logprobs():
    params = step_sampling_params(BeamSearchParams(3, 9, temperature=0.5), 1000, 20)
    assert (params.logprobs, params.max_tokens, params.temperature, params.n) == (6, 1, 0.5, 1)
    assert step_sampling_params(BeamSearchParams(9, 9), 4, 20).logprobs == 4  # all of V
    with pytest.raises(ValueError, match="at most 10"):
        step_sampling_params(BeamSearchParams(11, 9), 1000, 20)
    with pytest.raises(ValueError, match=r"at most 5 logprobs \(--max-logprobs\).* at most 2$"):
        step_sampling_params(BeamSearchParams(3, 9), 1000, 5)


def test_the_logprob_limit_named_is_the_one_that_binds():
    """Above 20 logprobs SamplingParams refuses whatever --max-logprobs says: the message
    must not send the user to raise --max-logprobs (it once did)."""
    with pytest.raises(ValueError, match="at most 20 logprobs") as raised:
        step_sampling_params(BeamSearchParams(11, 9), 1000, 40)
    assert "(--max-logprobs)" not in str(raised.value)
    assert "whatever --max-logprobs" in str(raised.value)


# -- the engine, against HF transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


PROMPTS = ["Hello", "The capital of France is"]


def hf_beams(model, tokenizer, prompt, k, max_tokens, length_penalty, eos):
    ids = tokenizer(prompt).input_ids
    return hf_beam_ids(model, ids, k, max_tokens, length_penalty, eos)


def hf_beam_ids(model, prompt_ids, k, max_tokens, length_penalty=1.0, eos=None):
    """HF's ``generate(num_beams=k)`` from ``prompt_ids``: the generated ids of its ``k``
    beams and their scores."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=0,
            length_penalty=length_penalty,
            return_dict_in_generate=True,
            output_scores=True,
        )
    tokens = [seq[ids.shape[1] :].tolist() for seq in out.sequences]
    return tokens, out.sequences_scores.tolist()


@pytest.mark.parametrize(
    ("beam_width", "length_penalty", "ignore_eos"),
    [(4, 1.0, True), (2, 0.0, True), (3, 2.0, False)],
)
def test_matches_hf_generate_when_no_beam_ends_on_eos(
    llm, hf_model, tiny_llama_dir, beam_width, length_penalty, ignore_eos
):
    """Without EOS (HF: ``eos_token_id=None``), or with an EOS never among the candidates,
    every beam has ``max_tokens`` tokens: the same beams, order and scores as HF's (whose
    score is ``cum_logprob / max_tokens ** length_penalty`` then)."""
    max_tokens = 7
    tokenizer = load_tokenizer(tiny_llama_dir)
    params = BeamSearchParams(
        beam_width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty
    )
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected, scores = hf_beams(
            hf_model,
            tokenizer,
            prompt,
            beam_width,
            max_tokens,
            length_penalty,
            None if ignore_eos else EOS,
        )
        assert {s.finish_reason for s in output.sequences} == {"length"}
        assert [s.output_token_ids for s in output.sequences] == expected
        got = [s.cum_logprob / max_tokens**length_penalty for s in output.sequences]
        assert got == pytest.approx(scores, abs=1e-4)


def test_beam_width_one_is_the_engines_greedy_output(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, logprobs=0))
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(1, 10))
    for expected, output in zip(greedy, outputs, strict=True):
        [sequence] = output.sequences
        completion = expected.outputs[0]
        assert sequence.output_token_ids == completion.token_ids
        assert sequence.tokens == expected.prompt_token_ids + completion.token_ids
        assert sequence.cum_logprob == pytest.approx(completion.cumulative_logprob, abs=1e-4)
        assert sequence.text == expected.prompt + completion.text  # vLLM's: prompt included


def test_temperature_adds_the_sampled_token_as_a_candidate(llm):
    [output] = llm.beam_search("Hello", BeamSearchParams(2, 5, temperature=1.0))
    assert len(output.sequences) == 2
    for sequence in output.sequences:
        assert len(sequence.output_token_ids) == 5
        assert all(len(p) in (4, 5) for p in sequence.logprobs)  # 2k best (+ the sampled)
        chosen = [
            p[t].logprob for p, t in zip(sequence.logprobs, sequence.output_token_ids, strict=True)
        ]
        assert sum(chosen) == pytest.approx(sequence.cum_logprob)


def test_steps_reuse_the_prefix_cache(llm):
    """Each step request computes at most its last, partial block: every full block is
    its parent's, cached. (Counted in tokens: queried minus found in the cache.)"""
    prompt = "A shared system prompt that is long enough to fill several KV cache blocks. " * 2
    manager = llm.engine.kv_cache_manager
    llm.generate(prompt, SamplingParams(max_tokens=1))  # the prompt itself, cached
    queries, hits = manager.prefix_cache_queries, manager.prefix_cache_hits
    [output] = llm.beam_search(prompt, BeamSearchParams(3, 4, ignore_eos=True))
    assert len(output.sequences) == 3
    num_requests = 1 + 3 * 3  # one beam in the first step, three in each later one
    num_prompt = output.sequences[0].num_prompt_tokens
    queried = manager.prefix_cache_queries - queries
    # every step request was looked up: the prompt, then 3 beams of prompt + s tokens
    assert queried == num_prompt + sum(3 * (num_prompt + s) for s in range(1, 4))
    computed = queried - (manager.prefix_cache_hits - hits)
    assert num_prompt > 2 * manager.block_size
    assert computed <= num_requests * manager.block_size


def test_bad_input_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search([[5] * 250], BeamSearchParams(2, 8))
    with pytest.raises(ValueError, match="at most 10"):
        llm.beam_search("Hello", BeamSearchParams(11, 8))
    with pytest.raises(ValueError, match="LoRA requests"):
        llm.beam_search(["a", "b"], BeamSearchParams(2, 2), lora_request=[None])


# -- exhaustive search on tiny vocabularies -------------------------------------------------------


@pytest.fixture(scope="module", params=[6, 4], ids=["vocab6", "vocab4"])
def tiny_vocab(request, tmp_path_factory):
    vocab = request.param
    fields = dict(TINY_CONFIG_FIELDS, vocab_size=vocab, tie_word_embeddings=False)
    directory = save_tiny_checkpoint(
        LlamaConfig(**fields), tmp_path_factory.mktemp(f"vocab{vocab}"), seed=3
    )
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    llm = LLM(
        str(directory),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=128,
        skip_tokenizer_init=True,
    )
    return vocab, model, llm


def hf_logprobs_of(model):
    cache: dict[tuple[int, ...], list[float]] = {}

    def logprobs_of(tokens: list[int]) -> list[float]:
        key = tuple(tokens)
        if key not in cache:
            with torch.inference_mode():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            cache[key] = torch.log_softmax(logits.double(), dim=-1).tolist()
        return cache[key]

    return logprobs_of


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 3.0])
def test_engine_search_is_exhaustive_search_on_a_tiny_vocabulary(tiny_vocab, length_penalty):
    vocab, model, llm = tiny_vocab
    # widths that cover every prefix: V-1 live beams after one step, (V-1)**2 after two
    max_tokens, beam_width = (2, 5) if vocab == 6 else (3, 9)
    params = BeamSearchParams(beam_width, max_tokens, length_penalty=length_penalty)
    prompts = [[1, 3, 0], [1, 0, 0, 3, 3, 1]]
    outputs = llm.beam_search(prompts, params)
    logprobs_of = hf_logprobs_of(model)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = exhaustive(prompt, logprobs_of, vocab, params)
        if length_penalty == 0.0:  # short sequences win: EOS takes part
            assert any(EOS in tokens for tokens, _ in expected)
        assert_same(returned(output), expected, tol=1e-4)
        for sequence in output.sequences:
            assert sequence.finish_reason == ("stop" if sequence.tokens[-1] == EOS else "length")
            assert sequence.text == ""  # no tokenizer


class HFRuleSearch(BeamSearch):
    """HF transformers' rule for finishing on EOS, in place of vLLM's: of the step's ``2k``
    best candidates (all beams together), an EOS one finishes only if it ranks among the
    ``k`` best; the rest is unchanged."""

    def _extend(self, index, beams, positions):
        candidates = [
            BeamSearchSequence(
                tokens=[*beam.tokens, token_id],
                logprobs=[*beam.logprobs, position],
                cum_logprob=beam.cum_logprob + lp.logprob,
                num_prompt_tokens=beam.num_prompt_tokens,
            )
            for beam, position in zip(beams, positions, strict=True)
            for token_id, lp in position.items()
        ]
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
        width = self.params.beam_width
        live = []
        for rank, candidate in enumerate(candidates[: 2 * width]):
            if candidate.tokens[-1] != EOS:
                live.append(candidate)
            elif rank < width:
                candidate.finish_reason = "stop"
                self._finished[index].append(candidate)
        return live[:width]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_with_length_penalty_zero_hf_differs_only_in_which_eos_candidates_finish(
    tiny_vocab, early_stopping
):
    """The claim docs/sampling.md makes: at ``length_penalty=0`` HF's ``generate`` and this
    search differ only in the EOS rule (HF's rule substituted, the results are HF's),
    whatever ``early_stopping`` (at 0 its bound is exact)."""
    vocab, model, llm = tiny_vocab
    params = BeamSearchParams(3, 6, length_penalty=0.0)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(vocab) for _ in range(rng.randrange(2, 6))] for _ in range(8)]
    step_params = step_sampling_params(params, vocab, 20)

    def step(beams):
        results = llm.generate([{"prompt_token_ids": b.token_ids} for b in beams], step_params)
        return [step_logprobs(r) for r in results]

    ours = llm.beam_search(prompts, params)
    with_hf_rule = run_beam_search(HFRuleSearch(prompts, params, [EOS]), step)
    differs = 0
    for prompt, vllm_rule, hf_rule in zip(prompts, ours, with_hf_rule, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=3,
                num_return_sequences=3,
                do_sample=False,
                max_new_tokens=6,
                eos_token_id=EOS,
                pad_token_id=0,
                length_penalty=0.0,
                early_stopping=early_stopping,
            )
        hf = [seq[len(prompt) :].tolist() for seq in out]
        hf = [tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens for tokens in hf]
        assert [s.output_token_ids for s in hf_rule.sequences] == hf
        differs += [s.output_token_ids for s in vllm_rule.sequences] != hf
    assert differs  # on a vocabulary this small, EOS often ranks below k and the rules differ


# -- AsyncLLM and the API server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir: Path):
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=256
        )
    )
    yield engine
    engine.shutdown_sync()


@pytest.fixture(scope="module")
def client(async_engine):
    with TestClient(build_app(async_engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        yield c


def test_async_llm_returns_what_llm_returns(async_engine, llm):
    params = BeamSearchParams(3, 6, length_penalty=0.5)

    async def both():
        return await asyncio.gather(
            *(async_engine.beam_search(p, params, f"bs-{i}") for i, p in enumerate(PROMPTS))
        )

    got = asyncio.run(both())
    expected = llm.beam_search(PROMPTS, params)
    for a, b in zip(got, expected, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.text for s in a.sequences] == [s.text for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx(
            [s.cum_logprob for s in b.sequences], abs=1e-4
        )


def test_completions_route(client, llm):
    body = {
        "prompt": PROMPTS,
        "use_beam_search": True,
        "n": 3,
        "max_tokens": 6,
        "temperature": 0,
        "length_penalty": 0.5,
        "logprobs": 1,
        "return_token_ids": True,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    expected = llm.beam_search(PROMPTS, BeamSearchParams(3, 6, length_penalty=0.5))
    tokenizer = llm.get_tokenizer()
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for p, output in enumerate(expected):
        for i, sequence in enumerate(output.sequences):
            choice = choices[p * 3 + i]
            assert choice["token_ids"] == sequence.output_token_ids
            assert choice["text"] == tokenizer.decode(
                sequence.output_token_ids, skip_special_tokens=True
            )
            assert choice["finish_reason"] == "length"
            logprobs = choice["logprobs"]
            assert len(logprobs["tokens"]) == 6
            assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
            assert sum(logprobs["token_logprobs"]) == pytest.approx(sequence.cum_logprob, abs=1e-4)
    assert data["usage"]["completion_tokens"] == 2 * 3 * 6


def test_chat_route(client, llm):
    body = {
        "messages": [{"role": "user", "content": "Hi!"}],
        "use_beam_search": True,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    [output] = llm.beam_search([data["prompt_token_ids"]], BeamSearchParams(2, 5, ignore_eos=True))
    assert [c["token_ids"] for c in data["choices"]] == [
        s.output_token_ids for s in output.sequences
    ]
    assert all(c["message"]["role"] == "assistant" for c in data["choices"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"n": 11}, "n"),
        ({"length_penalty": "Infinity"}, "length_penalty"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),  # was reported as prompt_logprobs
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"max_tokens": 300}, None),
    ],
)
def test_requests_beam_search_cannot_serve_are_400s(client, extra, param):
    body = {"prompt": "Hello", "use_beam_search": True, "n": 2, "temperature": 0, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_server_output_of_a_beam_that_ended_on_eos(llm):
    """The EOS that finished a beam is in ``token_ids`` (and its logprobs) only with
    ``include_stop_str_in_output``, as vLLM's server; text never shows it (special tokens
    are skipped unless asked); choices keep the search's order."""
    tokenizer = llm.get_tokenizer()
    hello = tokenizer("Hello world", add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    positions = [{t: Logprob(-0.5, 1), 7: Logprob(-2.0, 2)} for t in [*hello, eos]]
    finished = BeamSearchSequence(
        tokens=[5, 6, *hello, eos],
        logprobs=positions,
        cum_logprob=-1.5,
        finish_reason="stop",
        stop_reason=eos,
        num_prompt_tokens=2,
    )
    live = BeamSearchSequence(
        tokens=[5, 6, 9], logprobs=[{9: Logprob(-3.0, 4)}], cum_logprob=-3.0, num_prompt_tokens=2
    )
    live.finish_reason = "length"
    output = BeamSearchOutput([finished, live])
    for include, ids in ((False, hello), (True, [*hello, eos])):
        params = SamplingParams(include_stop_str_in_output=include, logprobs=0)
        result = to_request_output("r", output, params, tokenizer)
        first, second = result.outputs
        assert result.prompt_token_ids == [5, 6] and result.finished
        assert first.token_ids == ids and first.text == "Hello world"
        assert first.finish_reason == "stop" and first.stop_reason == eos
        assert len(first.logprobs) == len(ids)
        assert all(
            set(p) == {t} for p, t in zip(first.logprobs, ids, strict=True)
        )  # top 0 + chosen
        assert (second.index, second.token_ids, second.finish_reason) == (1, [9], "length")


def test_server_needs_only_the_engine_contract():
    """An engine with just the server's contract (serve/state.py; here the test double)
    serves beam search too: EOS from its tokenizer, every step through ``generate``."""
    from fake_engine import FakeAsyncLLM

    engine = FakeAsyncLLM()
    with TestClient(build_app(engine, ServerSettings())) as fake_client:
        body = {"prompt": "hi", "use_beam_search": True, "n": 3, "max_tokens": 4}
        response = fake_client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 3 and all(len(c["text"]) == 4 for c in choices)
    # one request per live beam and step: 1, then 3 for each of the 3 later steps
    assert len(engine.requests) == 1 + 3 * 3
    assert all(params.max_tokens == 1 and params.logprobs == 6 for *_, params, _ in engine.requests)


def metric(client: TestClient, name: str) -> float:
    """The value of the ``chassis:`` series whose name and labels start with ``name``."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"chassis:{name}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_a_search_as_the_one_request_sent(client):
    """A search went around the server's request tracking, so /metrics never saw it: no
    prompt or generation tokens, no finished request. It counts as the request the client
    sent: its usage, one finish reason per choice, one latency."""
    names = [
        "prompt_tokens_total",
        "generation_tokens_total",
        'request_success_total{engine="0",finished_reason="length"',
        "e2e_request_latency_seconds_count",
        "time_to_first_token_seconds_count",
    ]
    before = {name: metric(client, name) for name in names}
    body = {
        "prompt": PROMPTS,
        "use_beam_search": True,
        "n": 3,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2 * 3 * 4  # the returned choices' tokens
    delta = {name: metric(client, name) - before[name] for name in names}
    assert delta == {
        "prompt_tokens_total": usage["prompt_tokens"],
        "generation_tokens_total": usage["completion_tokens"],
        'request_success_total{engine="0",finished_reason="length"': 6,
        "e2e_request_latency_seconds_count": 2,  # one per prompt, as for other requests
        "time_to_first_token_seconds_count": 0,  # nothing reaches the client before the end
    }


def test_a_client_that_disconnects_stops_the_search(async_engine, monkeypatch):
    """The client hangs up mid-search: the step in flight is aborted (every one of its
    requests), no further step starts, and the choices count as aborted."""
    from test_server_lifecycle import AsgiCall, wait_until

    started: list[str] = []
    live: set[str] = set()
    generate = async_engine.generate

    async def watched(prompt, params, request_id, **kwargs):
        started.append(request_id)
        live.add(request_id)
        try:
            async with contextlib.aclosing(generate(prompt, params, request_id, **kwargs)) as s:
                async for output in s:
                    yield output
        finally:
            live.discard(request_id)

    monkeypatch.setattr(async_engine, "generate", watched)
    body = {
        "prompt": "Hello",
        "use_beam_search": True,
        "n": 4,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def scenario() -> None:
        app = build_app(async_engine, ServerSettings(shutdown_engine_on_exit=False))
        aborted = metric_of(app, 'request_success_total{engine="0",finished_reason="abort"')
        call = AsgiCall(app, "/v1/completions", body)
        task = call.start()
        await wait_until(lambda: len(started) >= 1 + 4 * 3, timeout=30)  # a few steps in
        call.hang_up.set()
        await asyncio.wait_for(task, 10)
        assert not live  # every request of the step in flight was closed (aborted)
        count = len(started)
        await asyncio.sleep(0.3)
        assert len(started) == count < 1 + 4 * 199  # and no step followed
        assert (
            metric_of(app, 'request_success_total{engine="0",finished_reason="abort"')
            == aborted + 4
        )
        assert call.status is None or call.status == 499

    asyncio.run(scenario())


def metric_of(app, name: str) -> float:
    text = get_state(app).metrics.render()[0].decode()
    for line in text.splitlines():
        if line.startswith(f"chassis:{name}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- LoRA adapters ----------------------------------------------------------------------------


def test_lora_adapters_reach_every_step(tiny_llama_dir, tmp_path):
    """Each prompt's adapter (one per prompt, ``None``: the base model) is applied to every
    step request: the beams are HF's beam search on the merged weights."""
    from fixtures_lora import hf_merged_model, write_peft_adapter

    from chassis.core.lora.request import LoRARequest

    adapter = write_peft_adapter(tmp_path / "a", tiny_llama_dir, rank=8, alpha=16)
    lora = LoRARequest("a", 1, str(adapter))
    engine = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        enable_lora=True,
    )
    prompt = [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033, 77, 5, 811, 64, 90]
    params = BeamSearchParams(3, 6, ignore_eos=True)
    with_adapter, without = engine.beam_search([prompt, prompt], params, lora_request=[lora, None])
    for output, adapter_dir in ((with_adapter, adapter), (without, None)):
        expected, _ = hf_beam_ids(hf_merged_model(tiny_llama_dir, adapter_dir), prompt, 3, 6)
        assert [s.output_token_ids for s in output.sequences] == expected
    assert [s.tokens for s in with_adapter.sequences] != [s.tokens for s in without.sequences]
    # one prompt at a time: each still gets its own adapter (the index within a chunk maps
    # back to the prompt's)
    chunked = engine.beam_search(
        [prompt, prompt], params, lora_request=[None, lora], concurrency_limit=1
    )
    assert [s.tokens for s in chunked[0].sequences] == [s.tokens for s in without.sequences]
    assert [s.tokens for s in chunked[1].sequences] == [s.tokens for s in with_adapter.sequences]
