"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in plain torch.

Per value head, a state ``S [k_dim, v_dim]`` is carried over the tokens. Token ``t`` (with
``q``, ``k`` L2-normalized, ``q`` scaled by ``k_dim ** -0.5``, ``g <= 0`` a log decay and
``beta`` in ``(0, 1)`` a write strength) does::

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T      # the delta rule: write the correction only
    o = S^T q

:func:`delta_rule_recurrence` is that loop (the reference); :func:`delta_rule_chunked`
gives the same result chunk by chunk: inside a chunk the corrections of all its tokens come
from one unit-lower-triangular solve, so the sequential part is one step per chunk;
:func:`delta_rule_chunked_varlen` runs it over sequences of different lengths packed one
after another (a step's prefill chunks).
Everything here is float32; inputs are ``[..., heads, ...]`` with the value heads already
matched (query/key heads repeated over their value heads by the caller).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (as the FLA kernels and HF)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for any leading batch shape ``B``: ``state [*B, k_dim, v_dim]``, ``q``/``k``
    ``[*B, k_dim]`` (normalized and scaled), ``v [*B, v_dim]``, ``g``/``beta`` ``[*B]``;
    returns ``(o [*B, v_dim], new state)``; ``state`` itself is left as it was.

    Products with the state are batched matrix products and the write is done in place on the
    decayed copy, so that besides ``state`` only the new state is as large as a state (a
    decode step of many requests holds little else: the start-up profile runs one)."""
    k_dim, v_dim = state.shape[-2:]
    state = state * g.exp()[..., None, None]  # (a new tensor, contiguous)
    predicted = (k[..., None, :] @ state)[..., 0, :]  # S^T k
    delta = (v - predicted) * beta[..., None]
    # S += k delta^T, as a rank-1 update of each head's matrix
    state.view(-1, k_dim, v_dim).baddbmm_(k.reshape(-1, k_dim, 1), delta.reshape(-1, 1, v_dim))
    return (q[..., None, :] @ state)[..., 0, :], state


def delta_rule_recurrence(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``L`` tokens of one sequence, one at a time. ``state [H, k_dim,
    v_dim]``, ``q``/``k`` ``[L, H, k_dim]``, ``v [L, H, v_dim]``, ``g``/``beta`` ``[L, H]``;
    returns ``(o [L, H, v_dim], final state)``."""
    outputs = []
    for t in range(q.shape[0]):
        o, state = delta_rule_step(state, q[t], k[t], v[t], g[t], beta[t])
        outputs.append(o)
    return torch.stack(outputs), state


def delta_rule_chunked(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``R`` sequences of ``L`` tokens each, chunk by chunk: ``state [R, H, k_dim,
    v_dim]``, ``q``/``k`` ``[R, L, H, k_dim]``, ``v [R, L, H, v_dim]``, ``g``/``beta``
    ``[R, L, H]``; returns ``(o [R, L, H, v_dim], final states)``, equal to
    :func:`delta_rule_recurrence` of each sequence.

    A sequence shorter than ``L`` is padded at its end with ``k = 0``, ``beta = 0`` and
    ``g = 0``: such tokens leave the state as it is, so its final state is still right.

    Within a chunk with cumulative log decay ``G`` (``G_t = g_1 + ... + g_t``) and start
    state ``S0``, the corrections ``d_t = beta_t (v_t - S'_t^T k_t)`` solve
    ``(I + A) d = beta V - beta e^G K S0`` with ``A[t, s] = beta_t e^(G_t - G_s) k_t . k_s``
    for ``s < t``; then ``o_t = e^G_t S0^T q_t + sum_{s <= t} e^(G_t - G_s) (q_t . k_s)
    d_s`` and the state after the chunk is ``e^G_C S0 + sum_s e^(G_C - G_s) k_s d_s^T``.
    """
    num_seqs, length, heads, _ = q.shape
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    num_chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [R, L, H, ...] -> [R, H, N, C, ...]
        x = x.reshape(num_seqs, num_chunks, chunk_size, heads, *x.shape[3:])
        return x.transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [R, H, N, C]
    # e^(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    strictly_lower = strictly_lower.tril(-1)
    system = strictly_lower + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    beta_v = v * beta[..., None]
    beta_k_decayed = k * (beta * cum.exp())[..., None]
    solved_v = torch.linalg.solve_triangular(system, beta_v, upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(
        system, beta_k_decayed, upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # [R, H, N, C, C], s <= t
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]  # G_C
    k_to_end = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [R, H, N, 1, 1]
    outputs = []
    for n in range(num_chunks):
        d = solved_v[:, :, n] - solved_k[:, :, n] @ state  # [R, H, C, v_dim]
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ d)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ d
    o = torch.stack(outputs, dim=2)  # [R, H, N, C, v_dim]
    o = o.transpose(1, 2).transpose(2, 3).reshape(num_seqs, num_chunks * chunk_size, heads, -1)
    return o[:, :length], state


@functools.lru_cache(maxsize=8)
def _padded_rows(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """Each packed token's row in a ``[R, max(lengths)]`` grid (request-major), and the
    grid's width. Cached: every layer of a step asks for the same one."""
    lens = np.asarray(lengths, dtype=np.int64)
    longest = int(lens.max())
    starts = np.cumsum(lens) - lens
    request_of_token = np.repeat(np.arange(len(lens)), lens)
    rows = request_of_token * longest + np.arange(int(lens.sum())) - starts[request_of_token]
    return torch.from_numpy(rows).to(device), longest


def delta_rule_chunked_varlen(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: Sequence[int],
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_rule_chunked` over ``R`` sequences packed one after another, sequence
    ``r``'s ``lengths[r]`` tokens contiguous: ``state [R, H, k_dim, v_dim]``, ``q``/``k``
    ``[T, H, k_dim]``, ``v [T, H, v_dim]``, ``g``/``beta`` ``[T, H]``; returns ``(o [T, H,
    v_dim], final states)``. The sequences are padded at their ends to the longest with
    zeros (tokens that leave a state as it is) and run as one batch."""
    rows, longest = _padded_rows(tuple(lengths), q.device)
    num_seqs = state.shape[0]

    def padded(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(num_seqs * longest, *x.shape[1:])
        grid.index_copy_(0, rows, x)
        return grid.view(num_seqs, longest, *x.shape[1:])

    o, new_state = delta_rule_chunked(
        state, padded(q), padded(k), padded(v), padded(g), padded(beta), chunk_size
    )
    return o.reshape(num_seqs * longest, *o.shape[2:])[rows], new_state
