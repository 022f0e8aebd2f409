"""The packed depthwise causal conv1d of the state-space layers (the Mamba-1 and Mamba2
mixers, LFM2's short conv, Qwen3-Next's Gated DeltaNet).

A step's requests have their tokens packed one after another, and each request carries its
last ``k - 1`` conv inputs (its conv state) from the step before. :func:`packed_causal_conv`
convolves every request's tokens at once: one channel-major sequence puts each request's
state before its tokens, one ``conv1d`` runs over all of it, and each token's output is the
window that ends at its own row (the windows that straddle two requests are computed and
never read: ``k - 1`` per request). The index layout is built on the host, in numpy, and
cached for the step's other layers (:func:`conv_layout`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from chassis.core.layers.step_split import index_tensor


@dataclass(frozen=True)
class ConvLayout:
    """Columns of the extended sequence :func:`packed_causal_conv` convolves: each request's
    ``k - 1`` conv-state columns (``state_rows``), then its tokens' (``token_rows [T]``);
    ``num_rows`` in all. ``windows [T]``: the conv output column of each token (the window
    ending at its row); ``last_rows [R, k - 1]``: each request's new conv state."""

    num_rows: int
    state_rows: torch.Tensor
    token_rows: torch.Tensor
    windows: torch.Tensor
    last_rows: torch.Tensor


@functools.lru_cache(maxsize=8)
def conv_layout(lengths: tuple[int, ...], k: int, device: torch.device) -> ConvLayout:
    """:class:`ConvLayout` for requests of ``lengths`` tokens and a conv window ``k``.
    Cached: every conv layer of a step asks for the same one."""
    lens = np.asarray(lengths, dtype=np.int64)
    segment = lens + (k - 1)  # a request's state rows and tokens
    segment_start = np.cumsum(segment) - segment
    token_start = np.cumsum(lens) - lens
    request_of_token = np.repeat(np.arange(len(lens)), lens)
    token_rows = (
        segment_start[request_of_token]
        + (k - 1)
        + np.arange(int(lens.sum()))
        - token_start[request_of_token]
    )
    return ConvLayout(
        num_rows=int(segment.sum()),
        state_rows=index_tensor((segment_start[:, None] + np.arange(k - 1)).reshape(-1), device),
        token_rows=index_tensor(token_rows, device),
        windows=index_tensor(token_rows - (k - 1), device),
        last_rows=index_tensor(
            (segment_start + segment - (k - 1))[:, None] + np.arange(k - 1), device
        ),
    )


def packed_causal_conv(
    conv: nn.Conv1d, states: torch.Tensor, x: torch.Tensor, lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal ``conv`` over several requests' tokens, each after its state.

    ``conv``: a depthwise ``nn.Conv1d`` (``groups`` = channels ``C``, window ``k``, its bias
    if it has one); ``x [T, C]``: request ``r``'s ``lengths[r]`` tokens contiguous, in order
    (a length may be 1); ``states [R, C, k - 1]``: each request's last ``k - 1`` inputs
    before these tokens (cast to ``x``'s dtype). Returns ``(out [T, C], new states [R, C,
    k - 1])``: token ``t``'s output is the conv of its window (the ``k - 1`` inputs before
    it, from the state where the request's tokens do not reach back, and itself), no
    activation; a request's new state is its last ``k - 1`` inputs. Equal to a ``conv1d``
    per request over its state and its tokens; both results may be views."""
    k, channels = conv.kernel_size[0], x.shape[-1]
    layout = conv_layout(tuple(lengths), k, x.device)
    # channel-major, so that the conv reads rows as they lie and no [T, k, C] windows exist
    extended = x.new_empty(channels, layout.num_rows)
    extended[:, layout.state_rows] = states.to(x.dtype).permute(1, 0, 2).reshape(channels, -1)
    extended.index_copy_(1, layout.token_rows, x.T)
    out = F.conv1d(extended[None], conv.weight, conv.bias, groups=channels)[0]
    new_states = extended[:, layout.last_rows].permute(1, 0, 2)
    return out.index_select(1, layout.windows).T, new_states
