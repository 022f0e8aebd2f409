"""Rejection sampling of probabilistic drafts (draft-model speculative decoding).

A draft model proposes ``x_1 .. x_d``, each drawn from its own distribution ``q_m`` given
the tokens before it; the target computes its distribution ``p_m`` at the same positions
(and ``p_{d+1}`` after the last draft). Walking the drafts in order, draft ``x_m`` is
accepted with probability ``min(1, p_m(x_m) / q_m(x_m))``; at the first rejection the token
output instead is drawn from ``normalize(max(p_m - q_m, 0))`` and the walk stops; when every
draft is accepted a bonus token is drawn from ``p_{d+1}``. Every token output then has the
law of the target's own sampling given the tokens output before it, whatever ``q`` is
(Leviathan et al. 2023, Chen et al. 2023).

Two implementations of one step, to be compared in tests:

- :func:`rejection_sample_reference`, one request, a plain loop over its drafts: the
  definition above;
- :func:`rejection_sample`, every row of every request at once on the device, no host
  synchronization. It yields one token per row, shaped so that
  :func:`chassis.core.speculative.accepted_tokens` (the exact-match rule the runner already
  applies) turns a request's rows into the same output: an accepted row yields its draft, a
  rejected one its residual draw (never the draft: ``max(p - q, 0)`` is 0 wherever
  ``p < q``, which is the only place a draft can be rejected), a bonus row a draw from ``p``.

Random numbers: each row consumes one uniform (the acceptance test) and one
``[vocab]`` vector of exponential noise (the draw, the default sampler's exponential race,
:mod:`chassis.core.token_draw`). Both functions accept them explicitly, so a test can feed
the same numbers to both; by default they come from the device's global generator.
"""

from __future__ import annotations

import torch

from chassis.core.token_draw import exponential_noise, exponential_race


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)`` per row (unnormalized); a row where it is all zero (``p == q``
    up to rounding, where a rejection has probability 0 anyway) falls back to ``p``."""
    rest = (target_probs - draft_probs).clamp_(min=0)
    empty = rest.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, rest)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    is_bonus: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token of each verify row, all requests at once (see the module docstring).

    :param target_probs: ``[rows, vocab]`` float32, ``p`` at each row
    :param draft_probs: ``[rows, vocab]`` float32, ``q`` of the draft the row verifies
        (anything, e.g. zeros, on bonus rows)
    :param draft_token_ids: ``[rows]`` int64, the draft each row verifies (any valid id on
        bonus rows)
    :param is_bonus: ``[rows]`` bool, the row after a request's last draft
    :param uniforms: ``[rows]`` Uniform[0, 1) values; drawn when None
    :param noise: ``[rows, vocab]`` Exponential(1) values; drawn when None
    :return: ``[rows]`` int64: the draft where accepted, else a draw from the residual
        (``p`` itself on bonus rows)
    """
    rows = target_probs.shape[0]
    if uniforms is None:
        uniforms = torch.rand(rows, device=target_probs.device)
    ids = draft_token_ids.unsqueeze(1)
    p_x = target_probs.gather(1, ids).squeeze(1)
    q_x = draft_probs.gather(1, ids).squeeze(1)
    # u < p / q without the division (q(x) > 0 for a draft drawn from q)
    accept = (uniforms * q_x < p_x) & ~is_bonus
    q = draft_probs.masked_fill(is_bonus.unsqueeze(1), 0.0)  # bonus rows draw from p
    drawn = exponential_race(residual(target_probs, q), noise=noise)
    return torch.where(accept, draft_token_ids, drawn)


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: list[int],
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> list[int]:
    """The tokens one request outputs: the definition, one draft at a time.

    ``target_probs`` is ``[d + 1, vocab]`` (``p`` after the last known token and after each
    draft), ``draft_probs`` ``[d, vocab]``, ``draft_token_ids`` the ``d`` drafts;
    ``uniforms`` (``[d + 1]``) and ``noise`` (``[d + 1, vocab]``) as for
    :func:`rejection_sample` (row ``m`` uses row ``m`` of each).
    """
    num_drafts = len(draft_token_ids)
    if uniforms is None:
        uniforms = torch.rand(num_drafts + 1)
    if noise is None:
        noise = exponential_noise(tuple(target_probs.shape), target_probs.device)
    out: list[int] = []
    for m, x in enumerate(draft_token_ids):
        p, q = target_probs[m], draft_probs[m]
        ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else float("inf")
        if float(uniforms[m]) < min(1.0, ratio):
            out.append(x)
            continue
        rest = (p - q).clamp(min=0)
        if float(rest.sum()) <= 0:
            rest = p
        out.append(int((rest / noise[m]).argmax()))
        return out
    out.append(int((target_probs[num_drafts] / noise[num_drafts]).argmax()))
    return out
