"""Rejection sampling of probabilistic drafts (core/rejection_sampling.py): the vectorized
step equals the one-draft-at-a-time reference on the same random numbers, and over many
seeded trials each emitted token has the target's sampling distribution."""

from __future__ import annotations

import torch
from fixtures_speculative import assert_requests_equal_the_reference

from chassis import SamplingParams
from chassis.builtin_plugins.samplers.default import DefaultSampler
from chassis.core.config import EngineConfig
from chassis.core.rejection_sampling import exponential_noise, rejection_sample
from chassis.core.sampling_metadata import SamplingRow, build_sampling_metadata
from chassis.core.speculative import accepted_tokens


def sampler_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The default sampler's distribution of each row of ``logits`` under ``params``."""
    rows = [SamplingRow(sampling_params=params, prompt_token_ids=[1], output_token_ids=[])]
    metadata = build_sampling_metadata(rows * logits.shape[0], "cpu", logits.shape[1])
    return DefaultSampler(EngineConfig()).probabilities(logits.clone(), metadata)


def test_the_default_sampler_gives_the_distribution_it_draws_from() -> None:
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    scaled = logits / 0.8
    scaled[scaled < scaled.topk(4, dim=-1).values[:, -1:]] = float("-inf")
    want = scaled.softmax(dim=-1)
    # top-p 0.9: the smallest prefix by probability reaching 0.9
    ordered, order = want.sort(dim=-1, descending=True)
    drop = ordered.cumsum(dim=-1) - ordered >= 0.9
    want = want.scatter(1, order, ordered.masked_fill(drop, 0.0))
    want /= want.sum(dim=-1, keepdim=True)
    assert torch.allclose(sampler_probs(logits, params), want, atol=1e-6)


def test_the_vectorized_step_equals_the_reference() -> None:
    """Requests with 0 to 4 drafts, drafts drawn from q, every row fed the same uniform and
    noise in both: the rows of each request, through the exact-match rule, give the
    reference's tokens."""
    generator = torch.Generator().manual_seed(5)
    torch.manual_seed(5)  # the noise
    vocab = 9
    for trial in range(200):
        num_drafts = [int(n) for n in torch.randint(0, 5, (3,), generator=generator)]
        p_rows, q_rows, ids, bonus, spans = [], [], [], [], []
        for d in num_drafts:
            p = torch.randn(d + 1, vocab, generator=generator).mul(2).softmax(dim=-1)
            # q close to p for some requests, unrelated for others
            q = torch.randn(d, vocab, generator=generator).mul(2).softmax(dim=-1)
            if trial % 2:
                q = (0.7 * p[:d] + 0.3 * q) if d else q
            drafts = [int(torch.multinomial(q[m], 1, generator=generator)) for m in range(d)]
            spans.append((len(ids), d, drafts))
            p_rows.append(p)
            q_rows.append(torch.cat([q, torch.zeros(1, vocab)]))
            ids += [*drafts, 0]
            bonus += [False] * d + [True]
        target, draft = torch.cat(p_rows), torch.cat(q_rows)
        uniforms = torch.rand(len(ids), generator=generator)
        noise = exponential_noise((len(ids), vocab), "cpu")
        tokens = rejection_sample(
            target, draft, torch.tensor(ids), torch.tensor(bonus), uniforms, noise
        ).tolist()
        assert_requests_equal_the_reference(tokens, target, draft, uniforms, noise, spans)


def test_each_emitted_token_has_the_targets_distribution() -> None:
    """20,000 seeded trials of one request with 2 drafts drawn from a draft distribution q
    that differs from the target's p (temperature 0.8, top-k 4, vocabulary of 6; the
    setting of the n-gram exactness test in test_speculative_decoding.py). Each draft is
    accepted with probability sum_x min(p(x), q(x)); the first token has law p after the
    last token, and after an accepted draft 0 the next token has law p after it."""
    vocab, trials = 6, 20000
    params = SamplingParams(temperature=0.8, top_k=4)
    generator = torch.Generator().manual_seed(3)
    p = sampler_probs(torch.randn(3, vocab, generator=generator), params)
    q = sampler_probs(torch.randn(2, vocab, generator=generator), params)
    torch.manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[m], trials, replacement=True) for m in (0, 1)], 1)
    ids = torch.cat([drafts, torch.zeros(trials, 1, dtype=torch.int64)], 1).reshape(-1)
    tokens = rejection_sample(
        p.repeat(trials, 1),
        torch.cat([q, torch.zeros(1, vocab)]).repeat(trials, 1),
        ids,
        torch.tensor([False, False, True]).repeat(trials),
    )
    outputs = [
        accepted_tokens(t, d)
        for t, d in zip(tokens.view(trials, 3).tolist(), drafts.tolist(), strict=True)
    ]

    def frequencies(tokens: list[int]) -> torch.Tensor:
        return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)

    accept = torch.minimum(p[:2], q).sum(dim=-1)  # per draft: sum_x min(p(x), q(x))
    assert abs(sum(len(o) > 1 for o in outputs) / trials - accept[0]) < 0.015
    assert abs(sum(len(o) == 3 for o in outputs) / trials - accept[0] * accept[1]) < 0.015
    assert (frequencies([o[0] for o in outputs]) - p[0]).abs().sum() / 2 < 0.03
    second = frequencies([o[1] for o in outputs if len(o) > 1])
    assert (second - p[1]).abs().sum() / 2 < 0.03
    third = frequencies([o[2] for o in outputs if len(o) > 2])
    assert (third - p[2]).abs().sum() / 2 < 0.04  # fewer samples: accept[0] * accept[1]


def test_a_draft_distribution_equal_to_the_targets_accepts_every_draft() -> None:
    vocab, rows = 11, 3000
    p = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).softmax(dim=-1)
    drafts = torch.multinomial(p, 1).squeeze(1)
    is_bonus = torch.zeros(rows, dtype=torch.bool)
    assert torch.equal(rejection_sample(p, p.clone(), drafts, is_bonus), drafts)
