"""The Mamba2 selective state-space scan ("SSD"), in float32 torch.

For one request, token ``t`` updates the state ``h [heads, head_dim, d_state]`` and reads it:

    h_t = exp(dt_t * A) * h_{t-1} + (dt_t * x_t) outer B_t
    y_t = h_t . C_t + D * x_t

``dt`` is already ``softplus(dt_raw + dt_bias)`` (clamped to the time-step limits), ``A`` is
``-exp(A_log)`` per head, and ``B``/``C`` are per group, each group shared by
``heads / groups`` consecutive heads. :func:`ssd_step` is one token (batched over requests,
the decode path); :func:`ssd_recurrence` is the token-by-token reference over one request;
:func:`ssd_chunked_varlen` computes the same for several requests at once in chunks
(quadratic within a chunk, the state carried between chunks), the prefill path, which tests
compare with the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., groups, d_state]`` -> ``[..., heads, d_state]`` (each group's row repeated for
    its consecutive heads)."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``R`` requests: ``state [R, H, P, N]``, ``x [R, H, P]``, ``dt [R, H]``,
    ``A``/``D`` ``[H]``, ``B``/``C`` ``[R, G, N]``; returns ``(y [R, H, P], new state)``,
    float32."""
    num_heads = x.shape[1]
    Bh = expand_groups(B.float(), num_heads)  # [R, H, N]
    Ch = expand_groups(C.float(), num_heads)
    x = x.float()
    decay = torch.exp(dt * A)  # [R, H]
    state = (
        state.float() * decay[:, :, None, None]
        + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    )
    y = torch.einsum("rhpn,rhn->rhp", state, Ch) + D[:, None] * x
    return y, state


def ssd_recurrence(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one request's ``L`` tokens one at a time. ``state [H, P, N]`` (the
    state before the first), ``x [L, H, P]``, ``dt [L, H]``, ``B``/``C`` ``[L, G, N]``;
    returns ``(y [L, H, P], state after the last)``, float32."""
    h = state.float()[None]
    ys = []
    for t in range(x.shape[0]):
        y, h = ssd_step(h, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        ys.append(y)
    return torch.cat(ys), h[0]


@dataclass(frozen=True)
class ChunkLayout:
    """Where :func:`ssd_chunked_varlen` finds each chunk's tokens: ``index [M, Q]`` (token
    rows; ``num_tokens``, the zero padding row, past a request's last token), ``valid``
    (the flat positions of real tokens in ``[M * Q]``), and per chunk position ``k`` among
    its request's chunks, ``(chunks, their requests)`` (``handover[k]``)."""

    index: torch.Tensor
    valid: torch.Tensor
    handover: tuple[tuple[torch.Tensor, torch.Tensor], ...]


@functools.lru_cache(maxsize=8)
def chunk_layout(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The chunks of requests of ``lengths`` packed tokens each, cut every ``chunk_size``
    tokens. Cached: every mixer layer of a step asks for the same one."""
    lens = np.asarray(lengths, dtype=np.int64)
    num_tokens = int(lens.sum())
    per_request = -(-lens // chunk_size)  # chunks of each request
    chunk_req = np.repeat(np.arange(len(lens)), per_request)
    first_chunk = np.cumsum(per_request) - per_request
    chunk_pos = np.arange(len(chunk_req)) - first_chunk[chunk_req]
    token_start = np.cumsum(lens) - lens
    offsets = chunk_pos[:, None] * chunk_size + np.arange(chunk_size)  # [M, Q] in the request
    rows = token_start[chunk_req][:, None] + offsets
    rows = np.where(offsets < lens[chunk_req][:, None], rows, num_tokens)

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    handover = tuple(
        (on_device(np.flatnonzero(chunk_pos == k)), on_device(chunk_req[chunk_pos == k]))
        for k in range(int(per_request.max()))
    )
    return ChunkLayout(
        index=on_device(rows),
        valid=on_device(np.flatnonzero(rows.reshape(-1) < num_tokens)),
        handover=handover,
    )


def ssd_chunked_varlen(
    states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    lengths: Sequence[int],
    chunk_size: int,
    max_chunks_at_once: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_recurrence` of several requests at once, in chunks: ``states [R, H, P,
    N]`` (each request's state before its tokens), ``x [T, H, P]``, ``dt [T, H]``,
    ``B``/``C`` ``[T, G, N]`` with request ``r``'s ``lengths[r]`` tokens contiguous, in
    order; returns ``(y [T, H, P], states after each request's last token)``, float32.

    Within a chunk every output is a decay-weighted sum over the chunk's earlier inputs (one
    masked matrix per head) plus the decayed state entering the chunk; the state leaving it
    is the entering state decayed plus each input's decayed contribution. Every request's
    tokens are cut into chunks of ``chunk_size`` (its last one padded with
    ``dt = 0``, which neither decays nor feeds the state); the work inside chunks runs for
    all chunks together (``max_chunks_at_once`` at a time, which bounds the ``[chunks, H,
    chunk, chunk]`` score tensors), and only the hand-over of states between a request's
    consecutive chunks loops, over the most chunks any request has."""
    device = x.device
    num_heads, head_dim = x.shape[1:]
    q = chunk_size
    layout = chunk_layout(tuple(lengths), q, device)
    index = layout.index  # [M, Q]
    num_chunks = index.shape[0]

    def chunked(t: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return padded[index]  # [M, Q, ...]

    xc = chunked(x.float())
    dtc = chunked(dt.float())
    Bc = chunked(expand_groups(B.float(), num_heads))
    Cc = chunked(expand_groups(C.float(), num_heads))
    log_decay = torch.cumsum(dtc * A, dim=1)  # [M, Q, H]
    xdt = xc * dtc[..., None]
    causal = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    y_intra = torch.empty_like(xc)
    local = xc.new_empty(num_chunks, num_heads, head_dim, B.shape[-1])
    for lo in range(0, num_chunks, max_chunks_at_once):
        hi = min(lo + max_chunks_at_once, num_chunks)
        ld = log_decay[lo:hi].transpose(1, 2)  # [m, H, Q]
        diff = ld[:, :, :, None] - ld[:, :, None, :]  # [m, H, t, u]
        weights = torch.exp(diff.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("mthn,muhn->mhtu", Cc[lo:hi], Bc[lo:hi]) * weights
        y_intra[lo:hi] = torch.einsum("mhtu,muhp->mthp", scores, xdt[lo:hi])
        to_end = torch.exp(log_decay[lo:hi, -1:] - log_decay[lo:hi])  # [m, Q, H]
        local[lo:hi] = torch.einsum("muh,muhp,muhn->mhpn", to_end, xdt[lo:hi], Bc[lo:hi])
    chunk_decay = torch.exp(log_decay[:, -1])  # [M, H]
    # hand the states over chunk by chunk: position k of every request at once
    current = states.float().clone()
    entering = torch.empty_like(local)
    for sel_t, reqs in layout.handover:
        h = current[reqs]
        entering[sel_t] = h
        current[reqs] = h * chunk_decay[sel_t][:, :, None, None] + local[sel_t]
    y_inter = torch.einsum("mthn,mhpn->mthp", Cc, entering) * torch.exp(log_decay)[..., None]
    y = (y_intra + y_inter + D[None, None, :, None] * xc).reshape(-1, num_heads, head_dim)
    return y[layout.valid], current
