"""Mamba-1's selective scan: a per-channel diagonal state-space recurrence.

Per token, channel ``i`` (of ``I``) and state index ``n`` (of ``N``), with ``dt > 0`` the
token's step size, ``A [I, N]`` (negative), ``B``/``C`` ``[N]`` shared by the channels::

    h[i, n] <- exp(dt[i] * A[i, n]) * h[i, n] + dt[i] * B[n] * x[i]
    y[i]     = sum_n h[i, n] * C[n] + D[i] * x[i]

States are float32 ``[I, N]`` per request. :func:`selective_step` advances a batch of
requests by one token each (decodes); :func:`selective_scan_varlen` runs several requests'
packed tokens at once, padded to the longest request with ``dt = 0`` (which leaves a state
exactly as it was), in one of two ways:

- the token loop (``reference=True``, the default): one batched
  :func:`selective_step` per token, the obviously-correct path;
- the parallel scan (``reference=False``, asked for): chunks of tokens, each an
  inclusive prefix scan (Hillis-Steele: ``log2(chunk)`` rounds over the ``(decay, input)``
  pairs), the state handed from chunk to chunk. It does ``log2`` times the loop's
  arithmetic in a few large kernels instead of a few small ones per token: slower than the
  loop on the CPU; whether its fewer kernel launches pay on a GPU is unmeasured (no GPU
  run), so it is not the default anywhere.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def selective_step(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``R`` requests: ``h [R, I, N]`` (float32), ``x``/``dt`` ``[R,
    I]``, ``A [I, N]``, ``B``/``C`` ``[R, N]``, ``D [I]``; returns ``(y [R, I] float32, new
    h)``."""
    x = x.float()
    h = torch.exp(dt[:, :, None] * A) * h + (dt * x)[:, :, None] * B.float()[:, None, :]
    y = torch.bmm(h, C.float()[:, :, None])[:, :, 0] + D * x
    return y, h


@functools.lru_cache(maxsize=8)
def _padded_rows(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """Flat indices into a ``[R, max(lengths)]`` grid of the packed tokens (request-major)."""
    longest = max(lengths)
    rows = np.concatenate([r * longest + np.arange(n) for r, n in enumerate(lengths)])
    return torch.from_numpy(rows.astype(np.int64)).to(device), longest


def selective_scan_varlen(
    h0: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    lengths: tuple[int, ...],
    *,
    reference: bool = True,
    max_chunk_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``R`` requests' tokens, request ``r``'s ``lengths[r]`` contiguous: ``h0 [R, I, N]``
    (float32), ``x``/``dt`` ``[T, I]``, ``B``/``C`` ``[T, N]``; returns ``(y [T, I]
    float32, final h [R, I, N])``, equal to :func:`selective_step` token after token.

    ``reference``: the token loop (``True``) or the parallel scan (``False``); ``None``:
    the loop on CPU tensors, the scan elsewhere. A chunk of the parallel scan holds as many
    tokens as keep its ``[R, chunk, I, N]`` tensors within ``max_chunk_elements`` elements
    (at least one token)."""
    rows, longest = _padded_rows(tuple(lengths), x.device)
    num_reqs, inner, d_state = h0.shape

    def padded(t: torch.Tensor) -> torch.Tensor:
        grid = t.new_zeros(num_reqs * longest, t.shape[-1], dtype=torch.float32)
        grid[rows] = t.float()
        return grid.view(num_reqs, longest, t.shape[-1])

    xp, dtp, Bp, Cp = padded(x), padded(dt), padded(B), padded(C)
    h = h0.float()
    if reference:
        ys = []
        for t in range(longest):
            y, h = selective_step(h, xp[:, t], dtp[:, t], A, Bp[:, t], Cp[:, t], D)
            ys.append(y)
        y_grid = torch.stack(ys, dim=1)
    else:
        chunk = max(1, max_chunk_elements // (num_reqs * inner * d_state))
        parts = []
        for start in range(0, longest, chunk):
            part = slice(start, start + chunk)
            states = _scan_chunk(h, xp[:, part], dtp[:, part], A, Bp[:, part])
            parts.append(torch.einsum("rlin,rln->rli", states, Cp[:, part]) + D * xp[:, part])
            h = states[:, -1]
        y_grid = torch.cat(parts, dim=1)
    return y_grid.reshape(num_reqs * longest, -1)[rows], h


def _scan_chunk(
    h: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor
) -> torch.Tensor:
    """The states after each of a chunk's ``L`` tokens, ``[R, L, I, N]``, from ``h [R, I,
    N]``: ``x``/``dt`` ``[R, L, I]``, ``B [R, L, N]``. An inclusive Hillis-Steele scan of
    ``h_t = decay_t * h_{t-1} + u_t`` (pairs combine as ``(a1, b1), (a2, b2) -> (a1 * a2,
    a2 * b1 + b2)``), ``h`` folded into the first token's input."""
    decay = torch.exp(dt[..., None] * A)  # [R, L, I, N]
    u = (dt * x)[..., None] * B[:, :, None, :]
    u[:, 0] += decay[:, 0] * h
    length = u.shape[1]
    offset = 1
    while offset < length:
        u = torch.cat([u[:, :offset], u[:, offset:] + decay[:, offset:] * u[:, :-offset]], 1)
        if offset * 2 < length:  # (the last round's decays are not read)
            decay = torch.cat([decay[:, :offset], decay[:, offset:] * decay[:, :-offset]], 1)
        offset *= 2
    return u
