"""``NgramIndex`` (core/speculative.py): the incremental n-gram proposer gives exactly the
drafts of the reference ``propose_ngram`` as its stream grows."""

from __future__ import annotations

import random

import pytest

from chassis.core.speculative import NgramIndex, propose_ngram


def random_stream(rng: random.Random, length: int) -> list[int]:
    """Tokens of one of several kinds: uniform over a small or a large vocabulary, a short
    period with mutations, or random text with copied passages."""
    kind = rng.choice(("small", "large", "periodic", "copies"))
    if kind in ("small", "large"):
        vocab = rng.choice((2, 3, 5)) if kind == "small" else 1000
        return [rng.randrange(vocab) for _ in range(length)]
    if kind == "periodic":
        period = [rng.randrange(20) for _ in range(rng.randint(1, 4))]
        tokens = [period[i % len(period)] for i in range(length)]
        for _ in range(length // 10):
            tokens[rng.randrange(length)] = rng.randrange(20)
        return tokens
    tokens: list[int] = []
    while len(tokens) < length:
        size = rng.randint(1, 12)
        if tokens and rng.random() < 0.6:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + size]
        else:
            tokens += [rng.randrange(50) for _ in range(size)]
    return tokens[:length]


def test_the_index_proposes_what_propose_ngram_proposes() -> None:
    """600 random streams fed in random pieces (1 token, accepted drafts, a long prompt),
    random n ranges, every number of drafts from 1 to 8 asked at every step."""
    rng = random.Random(20261130)
    checks = 0
    for _ in range(600):
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        stream = random_stream(rng, rng.randint(0, 120))
        index = NgramIndex(min_n, max_n)
        fed = 0
        while True:
            for max_drafts in range(0, 9):
                want = propose_ngram(stream[:fed], max_drafts, min_n, max_n)
                assert index.propose(max_drafts) == want, (stream[:fed], max_drafts, min_n, max_n)
                checks += 1
            if fed == len(stream):
                break
            piece = rng.choice((1, 1, 1, 2, 5, rng.randint(1, 40)))
            index.extend(stream[fed : fed + piece])
            fed = min(fed + piece, len(stream))
            assert index.num_tokens == fed
    assert checks > 30000


def test_catch_up_feeds_only_the_new_tokens_of_prompt_and_output() -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(4) for _ in range(30)]
    output: list[int] = []
    index = NgramIndex(2, 4)
    for _ in range(40):
        index.catch_up(prompt, output)
        assert index.num_tokens == len(prompt) + len(output)
        assert index.propose(4) == propose_ngram(prompt + output, 4, 2, 4)
        output += [rng.randrange(4) for _ in range(rng.randint(0, 5))]
    # a prompt only partly fed (chunks), then the output
    partial = NgramIndex(1, 3)
    partial.extend(prompt[:11])
    partial.catch_up(prompt, output)
    assert partial.propose(6) == propose_ngram(prompt + output, 6, 1, 3)
    with pytest.raises(ValueError, match="another stream"):
        partial.catch_up(prompt, output[:-1])


def test_the_preference_for_a_full_continuation_is_kept() -> None:
    """A short period: the latest occurrence overlaps the end; an earlier one gives all the
    drafts (the cases of propose_ngram's own test, fed one token at a time)."""
    for tokens, max_drafts, n, want in (
        ([1, 7, 7, 7, 7, 7, 7], 4, 2, [7, 7, 7, 7]),
        ([3, 4, 3, 4, 3, 4, 3, 4], 4, 2, [3, 4, 3, 4]),
        ([5, 5, 5], 2, 1, [5, 5]),
    ):
        index = NgramIndex(n, n)
        for token in tokens:
            index.extend([token])
        assert index.propose(max_drafts) == want == propose_ngram(tokens, max_drafts, n, n)


def test_bad_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(0, 2)
