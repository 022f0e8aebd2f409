"""LFM2's gated short convolution: a mixer in place of attention (``Lfm2ForCausalLM``'s
``"conv"`` layers).

Per token: ``in_proj`` gives ``B``, ``C`` and ``x`` (``hidden`` wide each); a depthwise causal
conv1d (window ``L``, no activation) runs over ``B * x``; the output is ``out_proj(C * conv)``.

Each request carries one tensor across steps (:meth:`ShortConv.state_specs`): the last
``L - 1`` conv inputs ``[hidden, L - 1]`` in the model dtype, read from its slot
(``ctx.state_slots``; zeroed when the request arrives) and written back every step. A step's
requests (decodes and prefill chunks alike) are convolved together: every request's state
rows are put before its tokens in one sequence and each token reads its window with one
gather (:func:`~chassis.core.layers.mamba2_mixer.conv_layout`).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import conv_layout
from chassis.core.request_state_cache import RequestStateSpec


class ShortConv(nn.Module):
    """One gated short-conv layer; its parameters are named as HF's ``Lfm2ShortConv``
    (``in_proj``, ``conv``, ``out_proj``; ``bias`` on all three or none).

    ``state_index`` is the position of this layer's conv state in the model's
    ``request_state_specs``. ``forward(hidden [T, hidden_size], ctx) -> [T, hidden_size]``.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool, state_index: int) -> None:
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"short conv window (conv_L_cache) must be >= 2, got {kernel_size}")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.state_index = state_index
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def state_specs(self, prefix: str, dtype: torch.dtype) -> list[RequestStateSpec]:
        """This layer's per-request tensor: the conv window ``[hidden, L - 1]`` in ``dtype``
        (the model's) unless --mamba-cache-dtype says otherwise (``kind`` ``"conv"``)."""
        shape = (self.hidden_size, self.kernel_size - 1)
        return [RequestStateSpec(f"{prefix}.conv", shape, dtype, kind="conv")]

    def graph_capture_blocker(self) -> str | None:
        return "short-conv layers read the step's request boundaries on the host (no graphs yet)"

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        metadata = ctx.attn_metadata
        num_reqs = metadata.num_reqs
        bounds = metadata.query_start_loc_cpu.tolist()[: num_reqs + 1]
        num_tokens = bounds[-1]
        k, width = self.kernel_size, self.hidden_size
        B, C, x = self.in_proj(hidden_states[:num_tokens]).chunk(3, dim=-1)
        bx = B * x

        if ctx.request_states is None or ctx.state_slots is None:
            # memory profiling: every request starts from zeros and nothing is kept
            pool = slots = None
            states = bx.new_zeros(num_reqs, width, k - 1)
        else:
            slots = ctx.state_slots
            pool = ctx.request_states[self.state_index]
            states = pool[slots]

        lengths = tuple(b - a for a, b in itertools.pairwise(bounds))
        layout = conv_layout(lengths, k, bx.device)
        extended = bx.new_empty(layout.num_rows, width)
        extended[layout.state_rows] = states.to(bx.dtype).transpose(1, 2).reshape(-1, width)
        extended[layout.token_rows] = bx
        window = extended[layout.windows]  # [T, k, hidden]
        conv_out = (window * self.conv.weight[:, 0, :].T).sum(1)
        if self.conv.bias is not None:
            conv_out = conv_out + self.conv.bias
        if pool is not None:
            new_states = extended[layout.last_rows].transpose(1, 2)
            pool.index_copy_(0, slots, new_states.to(pool.dtype))

        out = self.out_proj(C * conv_out)
        if num_tokens < hidden_states.shape[0]:  # padding rows past the step's tokens
            out = torch.cat([out, out.new_zeros(hidden_states.shape[0] - num_tokens, width)])
        return out
