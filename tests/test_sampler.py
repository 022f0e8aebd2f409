"""The built-in ``default`` sampler and ``build_sampling_metadata`` (CPU, vocab of 50)."""

from __future__ import annotations

import math

import pytest
import torch

from chassis.builtin_plugins.samplers import chassis_register_samplers
from chassis.builtin_plugins.samplers.default import DefaultSampler
from chassis.builtin_plugins.samplers.filters import apply_top_k_top_p
from chassis.builtin_plugins.samplers.penalties import (
    apply_penalties,
    apply_penalties_at_seen_tokens,
    token_counts,
)
from chassis.core.config import EngineConfig
from chassis.core.sampling_metadata import SamplingRow, build_sampling_metadata
from chassis.core.sampling_params import SamplingParams
from chassis.plugins.registry import Registry

VOCAB = 50
EOS = 7


@pytest.fixture(scope="module")
def sampler() -> DefaultSampler:
    return DefaultSampler(EngineConfig())


def random_logits(num_rows: int = 1, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=gen) * scale


def row(
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        sampling_params=params,
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        output_token_ids=output if output is not None else [],
        generator=generator,
        eos_token_ids=frozenset({EOS}),
    )


def run(sampler: DefaultSampler, logits: torch.Tensor, rows: list[SamplingRow]):
    metadata = build_sampling_metadata(rows, "cpu", VOCAB)
    return sampler(logits.clone(), metadata)


def draw_many(
    sampler: DefaultSampler, logits: torch.Tensor, params: SamplingParams, n: int = 4000
) -> torch.Tensor:
    """``n`` independent draws from one row's distribution (as ``n`` identical rows)."""
    torch.manual_seed(1234)
    return run(sampler, logits.expand(n, VOCAB), [row(params)] * n).sampled_token_ids


# --- registration -------------------------------------------------------------------------


def test_default_is_registered_and_resolves() -> None:
    registry: Registry = Registry("sampler")
    chassis_register_samplers(registry=registry)
    assert registry.get("default") is DefaultSampler


# --- builder ------------------------------------------------------------------------------


def test_builder_skips_unused_features() -> None:
    meta = build_sampling_metadata([row(SamplingParams(temperature=0.0))] * 2, "cpu", VOCAB)
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature.tolist() == [0.0, 0.0]
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert meta.logit_bias is None and meta.min_tokens_blocked is None
    assert meta.max_num_logprobs is None and meta.generators == {}


def test_all_greedy_steps_share_one_zero_temperature_vector() -> None:
    """An all-greedy step copies no temperatures to the device: its vector is a view of one
    shared zero vector, grown on demand (hence read-only)."""
    greedy = row(SamplingParams(temperature=0.0))
    small = build_sampling_metadata([greedy] * 3, "cpu", VOCAB).temperature
    again = build_sampling_metadata([greedy], "cpu", VOCAB).temperature
    assert small.data_ptr() == again.data_ptr() and again.tolist() == [0.0]
    large = build_sampling_metadata([greedy] * 300, "cpu", VOCAB).temperature
    assert large.shape == (300,) and not large.any()
    mixed = build_sampling_metadata([greedy, row(SamplingParams(temperature=0.5))], "cpu", VOCAB)
    assert mixed.temperature.tolist() == [0.0, 0.5]


def test_builder_greedy_rows_are_neutral_and_seedless() -> None:
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=3)
    rand = SamplingParams(temperature=0.8, top_k=5, top_p=0.5, min_p=0.2, seed=3)
    rows = [row(greedy, seed=3), row(rand, seed=3), row(SamplingParams(top_k=VOCAB + 10))]
    meta = build_sampling_metadata(rows, "cpu", VOCAB)
    assert not meta.all_greedy and not meta.all_random
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert meta.top_k.tolist() == [0, 5, 0]  # top_k >= vocab is off
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.5, 1.0])
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.2, 0.0])
    assert set(meta.generators) == {1}


def test_builder_penalties_histories_and_logprobs() -> None:
    rows = [
        row(SamplingParams(repetition_penalty=1.2), prompt=[1, 2], output=[3]),
        row(SamplingParams(presence_penalty=0.5, logprobs=3), prompt=[4], output=[5, 5]),
        row(SamplingParams(logprobs=1), prompt=[6], output=[8]),
    ]
    meta = build_sampling_metadata(rows, "cpu", VOCAB)
    assert meta.repetition_penalty.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert meta.presence_penalty.tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert meta.frequency_penalty is None
    # Only the repetition penalty reads the prompt; rows without penalties carry no history.
    assert meta.prompt_token_ids == [[1, 2], [], []]
    assert meta.output_token_ids == [[3], [5, 5], []]
    assert meta.max_num_logprobs == 3


def test_builder_min_tokens_blocked_sets() -> None:
    rows = [
        row(SamplingParams(min_tokens=2, stop_token_ids=[9, 99]), output=[1]),
        row(SamplingParams(min_tokens=2, stop_token_ids=[9]), output=[1, 2]),  # reached
        row(SamplingParams(min_tokens=3, ignore_eos=True), output=[]),  # nothing to block
        row(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[4])),
    ]
    meta = build_sampling_metadata(rows, "cpu", VOCAB)
    # 99 is past the vocabulary, so it cannot be sampled and is not blocked.
    assert meta.min_tokens_blocked == [{EOS, 9}, None, None, {4}]


def test_builder_rejects_out_of_vocab_logit_bias() -> None:
    rows = [row(SamplingParams(logit_bias={VOCAB: 1.0}))]
    with pytest.raises(ValueError, match="logit_bias: token id 50 is outside"):
        build_sampling_metadata(rows, "cpu", VOCAB)


def test_empty_batch(sampler: DefaultSampler) -> None:
    out = run(sampler, torch.empty(0, VOCAB), [])
    assert out.sampled_token_ids.shape == (0,)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax(sampler: DefaultSampler) -> None:
    logits = random_logits(6)
    out = run(sampler, logits, [row(SamplingParams(temperature=0.0))] * 6)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax(sampler: DefaultSampler) -> None:
    logits = random_logits(6, seed=1)
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)
    rows = [greedy, rand, greedy, rand, greedy, rand]
    for seed in range(5):
        torch.manual_seed(seed)
        out = run(sampler, logits, [row(p) for p in rows]).sampled_token_ids
        assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


# --- seeds --------------------------------------------------------------------------------


def _seeded_sequence(sampler, seed: int, others: int, position: int, steps: int = 8):
    """Tokens of one seeded row over ``steps`` steps, among ``others`` unseeded rows."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.5, top_p=0.95)
    tokens = []
    for step in range(steps):
        logits = random_logits(others + 1, seed=100 + step)
        # The seeded request always sees the same logits, whatever its position.
        logits[position] = random_logits(1, seed=500 + step)[0]
        rows = [row(SamplingParams(temperature=1.0)) for _ in range(others + 1)]
        rows[position] = SamplingRow(params, [1], list(tokens), generator, frozenset({EOS}))
        out = run(sampler, logits, rows).sampled_token_ids
        tokens.append(int(out[position]))
    return tokens


def test_same_seed_reproduces_regardless_of_batch(sampler: DefaultSampler) -> None:
    alone = _seeded_sequence(sampler, seed=42, others=0, position=0)
    torch.manual_seed(7)  # the global RNG must not matter for a seeded row
    again = _seeded_sequence(sampler, seed=42, others=0, position=0)
    torch.manual_seed(99)
    in_batch = _seeded_sequence(sampler, seed=42, others=5, position=3)
    assert alone == again == in_batch


def test_different_seeds_differ(sampler: DefaultSampler) -> None:
    sequences = {tuple(_seeded_sequence(sampler, seed=s, others=1, position=0)) for s in range(4)}
    assert len(sequences) == 4


# --- truncation filters -------------------------------------------------------------------


def _support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """Reference (slow, obviously correct) set of tokens a row may sample."""
    probs = torch.softmax(logits / temperature, -1).tolist()
    order = sorted(range(VOCAB), key=lambda t: (-probs[t], t))
    best = probs[order[0]]
    kept = [t for t in order if probs[t] >= min_p * best]
    if top_k:
        kept = kept[:top_k]
    total = sum(probs[t] for t in kept)
    nucleus, mass = [], 0.0
    for t in kept:
        nucleus.append(t)
        mass += probs[t] / total
        if mass >= top_p:
            break
    return set(nucleus)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05), (1, 1.0, 0.0)],
)
def test_filters_never_sample_outside_their_set(sampler, top_k, top_p, min_p) -> None:
    logits = random_logits(1, seed=3)
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = _support(logits[0], 1.3, top_k, top_p, min_p)
    assert 1 <= len(allowed) < VOCAB
    drawn = set(draw_many(sampler, logits, params).tolist())
    assert drawn <= allowed
    assert drawn == allowed  # every allowed token shows up in 4000 draws


@pytest.mark.parametrize("max_top_k", [None, 2, 4])
def test_top_k_keeps_exactly_k_with_ties(max_top_k: int | None) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [10, 20, 30]] = 5.0
    apply_top_k_top_p(logits, torch.tensor([2]), None, max_top_k)
    kept = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert len(kept) == 2 and set(kept) <= {10, 20, 30}


def test_candidate_path_matches_full_sort() -> None:
    """Ranking only ``max_top_k`` candidates gives the same result as sorting everything."""
    logits = random_logits(5, seed=11)
    top_k = torch.tensor([3, 0, 7, 1, 5])  # row 1 does not filter
    top_p = torch.tensor([0.8, 1.0, 0.5, 0.9, 1.0])
    full = apply_top_k_top_p(logits.clone(), top_k, top_p)
    fast = apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=7)
    assert torch.equal(full, fast)
    assert torch.equal(fast[1], logits[1])


@pytest.mark.parametrize("width", [3, 8, VOCAB - 1])
def test_nucleus_candidates_match_full_sort(width: int) -> None:
    """Top-p over a few ranked candidates (taken only when they hold the nucleus, else the
    full sort runs) keeps exactly the full sort's tokens; rows with p = 1 stay untouched."""
    logits = random_logits(6, seed=12)
    logits[5] = 0.0  # flat: its nucleus needs most of the vocabulary
    top_p = torch.tensor([0.3, 1.0, 0.6, 0.9, 0.05, 0.7])
    full = apply_top_k_top_p(logits.clone(), None, top_p)
    fast = apply_top_k_top_p(logits.clone(), None, top_p, nucleus_candidates=width)
    assert torch.equal(torch.isfinite(full[:5]), torch.isfinite(fast[:5]))
    # the flat row is all ties: which of them survive is unspecified, how many is not
    assert int(torch.isfinite(fast[5]).sum()) == int(torch.isfinite(full[5]).sum())
    assert torch.equal(fast[1], logits[1])
    # without the flat row, a small candidate set holds every nucleus and is used
    sharp = logits[:5].clone()
    used = apply_top_k_top_p(sharp.clone(), None, top_p[:5], nucleus_candidates=VOCAB // 2)
    assert torch.equal(torch.isfinite(used), torch.isfinite(full[:5]))


def test_default_sampler_ranks_nucleus_candidates_where_host_reads_are_free() -> None:
    from chassis.platforms import get_current_platform

    expected = DefaultSampler.NUCLEUS_CANDIDATES
    if not get_current_platform().host_reads_are_free():
        expected = None
    assert DefaultSampler(EngineConfig())._nucleus_candidates == expected


def test_builder_max_top_k_hint() -> None:
    def hint(*params: SamplingParams) -> int | None:
        return build_sampling_metadata([row(p) for p in params], "cpu", VOCAB).max_top_k

    assert hint(SamplingParams(top_k=5), SamplingParams(top_k=9, top_p=0.5)) == 9
    assert hint(SamplingParams(top_k=5), SamplingParams(min_p=0.1)) == 5  # min-p: no rank
    assert hint(SamplingParams(top_k=5), SamplingParams(top_p=0.5)) is None  # needs a sort
    assert hint(SamplingParams(top_p=0.5)) is None
    assert hint(SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=3)) == 3


def test_top_p_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])  # exact in binary floating point
    for p, expected in [(0.5, 1), (0.75, 2), (0.76, 3), (1.0, 4), (0.01, 1)]:
        logits = probs.log()
        apply_top_k_top_p(logits, None, torch.tensor([p]))
        assert int(torch.isfinite(logits).sum()) == expected, p


def test_a_top_p_below_float32_range_keeps_the_most_likely_token(sampler) -> None:
    # 1e-46 is 0 in float32, which once dropped every token (all -inf: token 0 every time)
    logits = torch.randn(1, VOCAB)
    best = int(logits.argmax())
    for p in (1e-46, 1e-300):
        params = SamplingParams(temperature=1.0, top_p=p, seed=0)
        assert int(run(sampler, logits, [row(params, seed=0)]).sampled_token_ids[0]) == best


# --- temperature and the distribution -----------------------------------------------------


def _chi_square_ok(drawn: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (bins with expectation >= 5) and its 0.1% critical value."""
    n = drawn.numel()
    observed = torch.bincount(drawn, minlength=VOCAB).double()
    expected = probs.double() * n
    big = expected >= 5
    small_obs, small_exp = observed[~big].sum(), expected[~big].sum()
    stat = float((((observed[big] - expected[big]) ** 2) / expected[big]).sum())
    bins = int(big.sum())
    if small_exp > 0:
        stat += float((small_obs - small_exp) ** 2 / small_exp)
        bins += 1
    df = bins - 1
    z = 3.09  # one-sided 0.1% (Wilson-Hilferty approximation of the chi-square quantile)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_frequencies_match_softmax_over_temperature(sampler, temperature: float) -> None:
    logits = random_logits(1, seed=5, scale=1.0)
    drawn = draw_many(sampler, logits, SamplingParams(temperature=temperature), n=20000)
    stat, critical = _chi_square_ok(drawn, torch.softmax(logits[0] / temperature, -1))
    assert stat < critical, (stat, critical)


def test_lower_temperature_is_sharper(sampler: DefaultSampler) -> None:
    logits = random_logits(1, seed=6, scale=1.0)
    top = int(logits.argmax())

    def top_share(t: float) -> float:
        drawn = draw_many(sampler, logits, SamplingParams(temperature=t))
        return float((drawn == top).double().mean())

    shares = [top_share(t) for t in (0.2, 0.5, 1.0, 3.0)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] > 0.9 and shares[-1] < 0.2


# --- penalties, bias, min_tokens ----------------------------------------------------------


def test_penalty_op_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0, 0.5]])
    prompt = token_counts([[0, 1]], 6, torch.device("cpu"))
    output = token_counts([[2, 2, 3]], 6, torch.device("cpu"))
    assert output.tolist() == [[0, 0, 2, 1, 0, 0]]
    apply_penalties(
        logits,
        prompt,
        output,
        repetition_penalty=torch.tensor([2.0]),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
    )
    expected = [
        2.0 / 2,  # prompt, positive: divided
        -1.0 * 2,  # prompt, negative: multiplied
        3.0 / 2 - 0.25 * 2 - 0.5,  # output twice
        -2.0 * 2 - 0.25 * 1 - 0.5,  # output once
        1.0,  # unseen
        0.5,
    ]
    assert logits[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("with_prompt", [True, False])
def test_penalties_at_seen_tokens_equal_the_dense_form(with_prompt: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    prompts = [[1, 2, 2, 7], [], [5, 5, 5], [0, 49]]
    outputs = [[2, 9, 9, 9], [3], [], [49, 0, 0]]  # a row with nothing seen at all
    repetition = torch.tensor([1.3, 1.0, 2.0, 0.8])  # 1.0: a row that does not use it
    presence = torch.tensor([0.5, 0.0, -0.25, 1.0])
    frequency = torch.tensor([0.2, 0.7, 0.0, -0.1])
    prompt_ids = prompts if with_prompt else None
    dense = logits.clone()
    apply_penalties(
        dense,
        token_counts(prompt_ids, VOCAB, dense.device) if with_prompt else None,
        token_counts(outputs, VOCAB, dense.device),
        repetition,
        presence,
        frequency,
    )
    # on a column slice of wider logits, as the runner hands the sampler
    wide = torch.cat([logits, torch.zeros(4, 3)], dim=1)
    sparse = apply_penalties_at_seen_tokens(
        wide[:, :VOCAB], prompt_ids, outputs, repetition, presence, frequency
    )
    assert torch.equal(sparse, dense)
    assert (wide[:, VOCAB:] == 0).all()
    # each penalty alone
    for args in [(repetition, None, None), (None, presence, None), (None, None, frequency)]:
        dense = logits.clone()
        apply_penalties(
            dense,
            token_counts(prompts, VOCAB, dense.device),
            token_counts(outputs, VOCAB, dense.device),
            *args,
        )
        sparse = apply_penalties_at_seen_tokens(logits.clone(), prompts, outputs, *args)
        assert torch.equal(sparse, dense)


def test_penalty_op_rows_are_independent() -> None:
    logits = torch.ones(2, 4)
    output = token_counts([[1], [2, 2]], 4, torch.device("cpu"))
    apply_penalties(logits, None, output, None, None, torch.tensor([1.0, 0.0]))
    assert logits.tolist() == [[1, 0, 1, 1], [1, 1, 1, 1]]


def test_penalties_change_choices_through_sampler(sampler: DefaultSampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 9] = 2.0, 1.5
    greedy = SamplingParams(temperature=0.0)
    assert run(sampler, logits, [row(greedy, output=[4])]).sampled_token_ids.item() == 4
    for params in (
        greedy.clone(repetition_penalty=1.5),  # 2 / 1.5 < 1.5
        greedy.clone(presence_penalty=1.0),
        greedy.clone(frequency_penalty=0.3),  # 2 - 0.3 * 2 < 1.5
    ):
        out = run(sampler, logits, [row(params, output=[4, 4])]).sampled_token_ids
        assert out.item() == 9, params
    # The repetition penalty also counts prompt tokens.
    params = greedy.clone(repetition_penalty=1.5)
    assert run(sampler, logits, [row(params, prompt=[4])]).sampled_token_ids.item() == 9


def test_repetition_penalty_shifts_distribution(sampler: DefaultSampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :5] = 2.0
    params = SamplingParams(repetition_penalty=2.0)
    torch.manual_seed(0)
    n = 4000
    out = run(sampler, logits.expand(n, VOCAB), [row(params, prompt=[0, 1])] * n)
    counts = torch.bincount(out.sampled_token_ids, minlength=VOCAB).double() / n
    probs = torch.softmax(torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0] + [0.0] * 45), -1).double()
    assert torch.allclose(counts[:5], probs[:5], atol=0.03)


def test_logit_bias(sampler: DefaultSampler) -> None:
    logits = random_logits(2, seed=8)
    low = int(logits[0].argmin())
    params = SamplingParams(temperature=0.0, logit_bias={low: 100.0})
    out = run(sampler, logits, [row(params), row(SamplingParams(temperature=0.0))])
    assert out.sampled_token_ids.tolist() == [low, int(logits[1].argmax())]
    # A -100 bias removes a token from random sampling in practice.
    top = int(logits[0].argmax())
    params = SamplingParams(temperature=1.0, logit_bias={top: -100.0})
    assert top not in draw_many(sampler, logits[:1], params, n=2000).tolist()


def test_min_tokens_blocks_eos_and_stop_ids(sampler: DefaultSampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 11], logits[0, 12] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11])
    assert run(sampler, logits, [row(params, output=[1])]).sampled_token_ids.item() == 12
    # Once min_tokens is reached nothing is blocked.
    assert run(sampler, logits, [row(params, output=[1, 2, 3])]).sampled_token_ids.item() == EOS
    # ignore_eos: EOS is never a stop token, so it is not blocked.
    params = params.clone(ignore_eos=True)
    assert run(sampler, logits, [row(params, output=[])]).sampled_token_ids.item() == EOS
    # Random rows too, over many draws.
    params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[11])
    drawn = set(draw_many(sampler, logits, params, n=2000).tolist())
    assert EOS not in drawn and 11 not in drawn


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_of_raw_logits(sampler: DefaultSampler) -> None:
    logits = random_logits(3, seed=9)
    params = [
        SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=1.7, logit_bias={3: 5}),
        SamplingParams(temperature=0.5, logprobs=2, top_k=3),
        SamplingParams(temperature=1.0),
    ]
    out = run(sampler, logits, [row(p, output=[int(logits[0].argmax())]) for p in params])
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == lp.logprobs.shape == (3, 5)
    assert lp.token_ids[:, 0].tolist() == sampled.tolist()
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top_lp, top_ids = raw.topk(4, dim=-1)
    assert lp.token_ids[:, 1:].tolist() == top_ids.tolist()
    assert torch.allclose(lp.logprobs[:, 1:], top_lp)
    assert (lp.logprobs[:, 1:].diff(dim=1) <= 0).all()  # descending
    order = raw.argsort(dim=-1, descending=True).tolist()
    for r in range(3):
        assert lp.ranks[r].item() == order[r].index(sampled[r].item()) + 1


def test_logprobs_zero_returns_only_sampled(sampler: DefaultSampler) -> None:
    logits = random_logits(2, seed=10)
    out = run(sampler, logits, [row(SamplingParams(temperature=0.0, logprobs=0))] * 2)
    assert out.logprobs.token_ids.shape == (2, 1)
    assert out.logprobs.ranks.tolist() == [1, 1]


# -- the runner's check of what a (plugin) sampler returns -----------------------------------


class _NamedSampler:
    """Stands in for a plugin's sampler: only its class name is used by the check."""


def test_check_sampler_output_names_the_sampler_and_the_broken_promise() -> None:
    from chassis.builtin_plugins.samplers.logprobs import gather_logprobs
    from chassis.core.sampler_interface import SamplerOutput, check_sampler_output
    from chassis.core.sampling_metadata import SamplingMetadata

    plain = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False)
    wants_2 = SamplingMetadata(
        temperature=torch.zeros(3), all_greedy=True, all_random=False, max_num_logprobs=2
    )
    logits = torch.randn(3, 11)
    ids = logits.argmax(dim=-1)
    good = SamplerOutput(ids, gather_logprobs(torch.log_softmax(logits, -1), ids, 2))
    check_sampler_output(SamplerOutput(ids), plain, _NamedSampler())
    check_sampler_output(good, wants_2, _NamedSampler())
    broken = [
        (ids.tolist(), plain, "returned list, not a SamplerOutput"),
        (SamplerOutput(ids.to(torch.int32)), plain, "expected an int64 tensor of shape (3,)"),
        (SamplerOutput(ids[:2]), plain, "shape (2,)"),
        (SamplerOutput(logits.topk(2).indices), plain, "shape (3, 2)"),
        (SamplerOutput(ids), wants_2, "returned no logprobs"),
        (
            SamplerOutput(ids, gather_logprobs(torch.log_softmax(logits, -1), ids, 1)),
            wants_2,
            "expected (3, 3)",
        ),
    ]
    for output, metadata, message in broken:
        with pytest.raises(TypeError, match=r"sampler _NamedSampler") as info:
            check_sampler_output(output, metadata, _NamedSampler())
        assert message in str(info.value)


# --- allowed_token_ids and bad words --------------------------------------------------------


def test_allowed_token_ids_restrict_greedy_and_random_rows(sampler: DefaultSampler) -> None:
    logits = random_logits(3, seed=5)
    allowed = [3, 11, 40]
    rows = [
        row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
        row(SamplingParams(temperature=1.0, allowed_token_ids=allowed), seed=1),
        row(SamplingParams(temperature=0.0)),
    ]
    out = run(sampler, logits, rows).sampled_token_ids.tolist()
    assert out[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out[1] in allowed
    assert out[2] == int(logits[2].argmax())  # other rows untouched
    draws = draw_many(sampler, random_logits(1, seed=6), SamplingParams(allowed_token_ids=allowed))
    assert set(draws.tolist()) == set(allowed)


def test_bad_words_block_the_token_that_would_complete_them(sampler: DefaultSampler) -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0  # every row's favourite
    logits[:, 8] = 4.0
    words = [[4, 9], [30]]  # "4 9" (two tokens) and a one-token word
    rows = [
        row(SamplingParams(temperature=0.0, bad_words_token_ids=words), output=[1, 4]),
        row(SamplingParams(temperature=0.0, bad_words_token_ids=words), output=[4, 1]),
        row(SamplingParams(temperature=0.0, bad_words_token_ids=[[9]]), output=[]),
    ]
    meta = build_sampling_metadata(rows, "cpu", VOCAB)
    assert meta.bad_word_tokens == [{9, 30}, {30}, {9}]
    assert all(r.reads_output_history for r in rows[:2])
    assert sampler(logits.clone(), meta).sampled_token_ids.tolist() == [8, 9, 8]
    plain = build_sampling_metadata([row(SamplingParams())], "cpu", VOCAB)
    assert plain.allowed_token_ids is None and plain.bad_word_tokens is None


def test_token_restrictions_are_validated() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids: must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="allowed_token_ids: a token id is outside"):
        build_sampling_metadata([row(SamplingParams(allowed_token_ids=[VOCAB]))], "cpu", VOCAB)
