"""Sampling, stop conditions and logprobs through the real ``LLM`` with the tiny Llama model.

Greedy runs are the references: the tiny random model's choices are deterministic, so each
sampling feature is checked against what greedy decoding does on the same prompt. Logprobs
are checked against HF transformers' ``log_softmax`` of the same checkpoint's logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from chassis import LLM, SamplingParams

PROMPT = "The capital of France is"
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
    )


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def greedy(llm: LLM, prompt: str = PROMPT, max_tokens: int = 16, **params):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return llm.generate([prompt], params)[0].outputs[0]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(autouse=True)
def blocks_come_back(llm):
    """Whatever a test does, every KV block is free when it ends."""
    yield
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS


# -- seeds, n, top-k, logit bias -------------------------------------------------------------


def test_seed_reproduces_tokens_whatever_else_is_batched(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Other prompt one", PROMPT, "A third, longer prompt with more tokens in it", PROMPT],
        [
            SamplingParams(temperature=1.0, max_tokens=20),
            seeded,
            SamplingParams(temperature=0.0, max_tokens=5),
            SamplingParams(temperature=0.7, top_p=0.9, seed=99, max_tokens=16),
        ],
    )
    assert batch[1].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids != alone


def test_different_seeds_give_different_tokens(llm):
    outputs = llm.generate(
        [PROMPT] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in (1, 2, 3)]
    )
    first, second, third = token_ids(outputs)
    assert first != second and second != third and first != third


def test_n_returns_n_distinct_indexed_completions(llm):
    out = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=8))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.finished


def test_n_with_seed_is_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    first = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    second = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) == 3  # child i uses seed + i


def test_top_k_1_is_greedy(llm):
    expected = greedy(llm).token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_k=1, max_tokens=16))
    assert out[0].outputs[0].token_ids == expected


def test_logit_bias_forces_a_token(llm):
    forced = 1234
    assert forced not in greedy(llm).token_ids
    out = greedy(llm, max_tokens=6, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 6


def test_allowed_token_ids_limit_the_output(llm):
    expected = greedy(llm).token_ids
    allowed = sorted(set(expected[1:4]) | {1234, 4321})
    out = greedy(llm, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    assert out.token_ids != expected


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    n = len(sequence)
    return any(tokens[i : i + n] == sequence for i in range(len(tokens) - n + 1))


def test_bad_words_are_never_written(llm):
    """A two-token stretch of the greedy output that the tokenizer writes the same way: as a
    bad word, neither of its tokenizations appears in the output any more."""
    tokenizer = llm.get_tokenizer()
    expected = greedy(llm).token_ids
    word, sequences = None, []
    for i in range(len(expected) - 1):
        text = tokenizer.decode(expected[i : i + 2]).strip()
        sequences = [tokenizer.encode(t, add_special_tokens=False) for t in (text, " " + text)]
        if text and any(_contains(expected, s) for s in sequences):
            word = text
            break
    assert word is not None, "no two-token stretch the tokenizer writes the same way"
    out = greedy(llm, bad_words=[word])
    assert out.token_ids != expected
    assert not any(_contains(out.token_ids, s) for s in sequences)


# -- stop conditions -------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(llm):
    out = greedy(llm, max_tokens=5)
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def test_stop_token_id_finishes_with_stop(llm):
    reference = greedy(llm).token_ids
    stop_at = 5
    stop_id = reference[stop_at]
    first = reference.index(stop_id)  # the earliest occurrence is where it stops
    out = greedy(llm, stop_token_ids=[stop_id])
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


def test_min_tokens_blocks_stop_tokens_until_reached(llm):
    reference = greedy(llm).token_ids
    # The greedy second token, as a stand-in EOS: without min_tokens it stops at 2 tokens.
    stop_id = reference[1]
    assert reference[0] != stop_id
    stopped = greedy(llm, stop_token_ids=[stop_id], ignore_eos=False)
    assert stopped.token_ids == reference[:2]

    out = greedy(llm, stop_token_ids=[stop_id], ignore_eos=False, min_tokens=3)
    assert len(out.token_ids) > 2
    assert out.token_ids[0] == reference[0]
    assert stop_id not in out.token_ids[:3]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_id and len(out.token_ids) >= 3


def test_min_tokens_holds_back_the_real_eos(llm):
    """EOS pushed to the top by a huge bias still waits for min_tokens, then stops with it."""
    eos = llm.input_processor.eos_token_ids[0]
    out = greedy(llm, logit_bias={eos: 100.0}, min_tokens=3)
    assert len(out.token_ids) == 4
    assert eos not in out.token_ids[:3]
    assert out.token_ids[3] == eos
    assert out.finish_reason == "stop"
    assert out.stop_reason is None
    # With ignore_eos it runs to max_tokens instead.
    out = greedy(llm, max_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True)
    assert out.token_ids == [eos] * 6
    assert out.finish_reason == "length"


def _middle_substring(text: str, length: int = 3) -> tuple[str, int]:
    """A substring from the middle of ``text`` whose first occurrence is where it was taken."""
    for start in range(len(text) // 2, len(text) - length):
        candidate = text[start : start + length]
        if text.find(candidate) == start and candidate.strip() == candidate:
            return candidate, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates_the_text(llm):
    reference = greedy(llm, max_tokens=16, ignore_eos=True)
    stop, start = _middle_substring(reference.text)

    out = greedy(llm, max_tokens=16, ignore_eos=True, stop=[stop])
    assert out.text == reference.text[:start]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < len(reference.token_ids)
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]

    kept = greedy(llm, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == reference.text[: start + len(stop)]
    assert kept.finish_reason == "stop"
    assert kept.stop_reason == stop


# -- logprobs --------------------------------------------------------------------------------


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]``: HF's log_softmax of the logits at every position."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_sample_logprobs_match_hf(llm, hf_model):
    prompt = "Logprobs are checked against transformers here"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0]
    completion = out.outputs[0]
    expected = hf_logprobs(hf_model, out.prompt_token_ids + completion.token_ids)
    num_prompt = len(out.prompt_token_ids)

    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for step, (token, position) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        row = expected[num_prompt - 1 + step]
        assert position[token].rank == 1
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top_values, top_ids = row.topk(3)
        # Greedy: the sampled token is the top one, so the entry holds exactly the top 3.
        assert list(position) == top_ids.tolist()
        for rank, (token_id, value) in enumerate(
            zip(top_ids.tolist(), top_values.tolist(), strict=True), start=1
        ):
            assert position[token_id].rank == rank
            assert position[token_id].logprob == pytest.approx(value, abs=1e-4)
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_hf(llm, hf_model):
    prompt = "Prompt logprobs of every position, compared with transformers"
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate([prompt], params)[0]
    ids = out.prompt_token_ids
    expected = hf_logprobs(hf_model, ids)

    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        position = out.prompt_logprobs[p]
        row = expected[p - 1]
        token = ids[p]
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert position[token].rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(2)
        for rank, (token_id, value) in enumerate(
            zip(top_ids.tolist(), top_values.tolist(), strict=True), start=1
        ):
            if token_id != token:
                assert position[token_id].rank == rank
            assert position[token_id].logprob == pytest.approx(value, abs=1e-4)

    # The same prompt again: its blocks are in the prefix cache now, yet the prompt logprobs
    # must still cover every position (a request with prompt_logprobs computes them all).
    again = llm.generate([prompt], params)[0]
    assert again.prompt_logprobs == out.prompt_logprobs
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_in_slices_of_a_few_positions(llm, monkeypatch):
    """Prompt logprobs are computed a bounded number of positions at a time (their full-vocab
    tensors are not in the KV budget); slicing changes nothing in the result."""
    from chassis.core import prompt_logprobs

    prompt = "Prompt logprobs computed three positions at a time give the same numbers"
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    whole = llm.generate([prompt], params)[0].prompt_logprobs
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 3)
    sliced = llm.generate([prompt], params)[0].prompt_logprobs
    assert len(sliced) == len(whole) > 7
    for got, want in zip(sliced[1:], whole[1:], strict=True):
        assert got.keys() == want.keys()
        for token_id, logprob in got.items():
            assert logprob.rank == want[token_id].rank
            assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)
