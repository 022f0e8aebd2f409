"""Temperature and the truncation filters (min-p, top-k, top-p) of random sampling.

Filters set removed tokens to ``-inf`` in place, so the softmax that follows gives them
probability exactly 0 and the exponential race can never pick them. All work is on the
device with no host synchronization.
"""

from __future__ import annotations

import torch

from chassis.core.sampling_metadata import SAMPLING_EPS


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature in place; greedy rows (``< SAMPLING_EPS``) by 1."""
    safe = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits.div_(safe.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens whose probability is below ``min_p * max_prob`` of their row, in place.

    Done in logit space (``x < max_x + log(min_p)``), which needs no softmax; ``min_p == 0``
    gives ``log(0) = -inf`` and removes nothing. The top token always survives.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
    nucleus_candidates: int | None = None,
) -> torch.Tensor:
    """Keep each row's top-k tokens, then the top-p nucleus of what remains, in place.

    - top-k (``0`` = off) keeps exactly ``k`` tokens; which of several tokens tied at the
      boundary survive is unspecified.
    - top-p (``1.0`` = off) keeps the smallest prefix of the tokens sorted by probability
      (after top-k and any earlier filter, renormalized) whose cumulative probability
      reaches ``p``; the most likely token is always kept; which of several tokens tied
      at the boundary survive is unspecified.

    :param max_top_k: when every row that filters has ``0 < top_k <= max_top_k`` (see
        ``SamplingMetadata.max_top_k``), only the ``max_top_k`` best tokens are ranked
        instead of sorting the whole vocabulary; ``None`` always sorts everything.
    :param nucleus_candidates: top-p without top-k: first rank only this many best tokens
        per row, and use them when each filtering row's nucleus lies within them (checked on
        the host, so only for devices whose host reads are free); otherwise, or ``None``,
        sort everything. Either way the same tokens survive (up to float rounding of the
        running sums, which can matter only for a token whose mass before it is within
        ~1e-6 of ``p``).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    if top_k is not None and max_top_k is not None and max_top_k < vocab_size:
        return _filter_candidates(logits, top_k, top_p, max_top_k)
    if (
        top_k is None
        and top_p is not None
        and nucleus_candidates is not None
        and nucleus_candidates < vocab_size
        and _nucleus_from_candidates(logits, top_p, nucleus_candidates)
    ):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = _sorted_drop_mask(sorted_logits, top_k, top_p)
    unsorted_drop = torch.empty_like(drop).scatter_(-1, order, drop)
    return logits.masked_fill_(unsorted_drop, float("-inf"))


def _filter_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """The top-k/top-p filter ranking only each row's ``max_top_k`` best tokens.

    Exact for rows with ``0 < k <= max_top_k``: everything past the candidates is beyond
    their top-k. Rows with ``k == 0`` (no filter, by the ``max_top_k`` contract) are left
    as they are.
    """
    candidates, ids = logits.topk(max_top_k, dim=-1)  # sorted, descending
    filters = (top_k > 0).unsqueeze(1)
    drop = _sorted_drop_mask(candidates.clone(), top_k, top_p)
    # Rows that do not filter get their own candidates back, unchanged.
    kept = torch.where(filters, candidates.masked_fill(drop, float("-inf")), candidates)
    # Only [num_rows, max_top_k]-sized work besides one fill of the filtering rows.
    return logits.masked_fill_(filters, float("-inf")).scatter_(-1, ids, kept)


def _nucleus_from_candidates(logits: torch.Tensor, top_p: torch.Tensor, width: int) -> bool:
    """Top-p over each row's ``width`` best tokens, in place, if that is exact; returns whether
    it was (else ``logits`` is untouched and the caller sorts everything).

    The candidates' probabilities are taken under the softmax of the whole row, so their
    running sums are the full sort's; the nucleus ends inside them when they hold at least
    ``p`` of the mass. A host check of that decides, so this runs only where host reads of
    device values are free. Rows with ``top_p == 1`` are left as they are.
    """
    candidates, ids = logits.topk(width, dim=-1)  # sorted, descending
    top = candidates[:, :1]
    normalizer = (logits - top).exp().sum(dim=-1, keepdim=True)
    probs = (candidates - top).exp() / normalizer
    mass = probs.cumsum(dim=-1)
    filters = top_p < 1.0
    if not bool(((mass[:, -1] >= top_p) | ~filters).all()):
        return False
    drop = (mass - probs) >= top_p.unsqueeze(1)
    rows = filters.unsqueeze(1)
    kept = torch.where(rows, candidates.masked_fill(drop, float("-inf")), candidates)
    logits.masked_fill_(rows, float("-inf")).scatter_(-1, ids, kept)
    return True


def _sorted_drop_mask(
    sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Which positions of descending ``sorted_logits`` the filters remove (modifies it)."""
    width = sorted_logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, width)
        drop = torch.arange(width, device=sorted_logits.device).unsqueeze(0) >= k.unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Probability mass strictly before each position; the first position has 0 < p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
    return drop
