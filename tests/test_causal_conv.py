"""The packed depthwise causal conv (:mod:`chassis.core.layers.causal_conv`) against a
``conv1d`` per request over its state and its tokens: requests of 1, 2, 5 and 9 tokens
from random states, with and without a bias, windows 2 to 4; outputs and new states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chassis.core.layers.causal_conv import packed_causal_conv

LENGTHS = (5, 1, 9, 2)


@pytest.mark.parametrize("window", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_conv_is_a_conv_per_request(window: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(window)
    channels = 6
    conv = torch.nn.Conv1d(channels, channels, window, groups=channels, bias=bias)
    with torch.no_grad():
        for param in conv.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    x = torch.randn(sum(LENGTHS), channels, generator=gen)
    states = torch.randn(len(LENGTHS), channels, window - 1, generator=gen)
    with torch.no_grad():
        out, new_states = packed_causal_conv(conv, states, x, LENGTHS)
    start = 0
    for r, length in enumerate(LENGTHS):
        sequence = torch.cat([states[r], x[start : start + length].T], dim=-1)
        expected = F.conv1d(sequence[None], conv.weight, conv.bias, groups=channels)[0].T
        torch.testing.assert_close(out[start : start + length], expected)
        torch.testing.assert_close(new_states[r], sequence[:, -(window - 1) :])
        start += length
