"""LFM2's gated short convolution: a mixer in place of attention (``Lfm2ForCausalLM``'s
``"conv"`` layers).

Per token: ``in_proj`` gives ``B``, ``C`` and ``x`` (``hidden`` wide each); a depthwise causal
conv1d (window ``L``, no activation) runs over ``B * x``; the output is ``out_proj(C * conv)``.

Each request carries one tensor across steps (:meth:`ShortConv.state_specs`): the last
``L - 1`` conv inputs ``[hidden, L - 1]`` in the model dtype, read from its slot
(``ctx.state_slots``; zeroed when the request arrives) and written back every step. A step's
requests (decodes and prefill chunks alike) are convolved together: every request's state
rows are put before its tokens in one sequence and one conv1d runs over it
(:func:`~chassis.core.layers.causal_conv.packed_causal_conv`).

Under tensor parallelism each rank keeps ``hidden / N`` channels (its rows of each of
``in_proj``'s three parts and of ``conv``, its columns of ``out_proj``, whose partial outputs
are summed over the group); the checkpoint's whole tensors load through
:meth:`ShortConv.checkpoint_part`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.causal_conv import packed_causal_conv
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
        #: this rank's channels: ``width`` of them from ``first_channel`` (all of them
        #: without tensor parallelism)
        self.first_channel, width = parallel_state.shard(hidden_size, "hidden_size")
        self.width = width
        self.kernel_size = kernel_size
        self.state_index = state_index
        self.in_proj = nn.Linear(hidden_size, 3 * width, bias=bias)
        self.conv = nn.Conv1d(width, width, kernel_size, groups=width, bias=bias)
        self.out_proj = nn.Linear(width, hidden_size, bias=bias)

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """This rank's part of the checkpoint's whole tensor ``leaf`` of this layer
        (``in_proj.weight``, ...; ``what``, the checkpoint name, for errors): its channels'
        rows of each ``in_proj`` part (``B``, ``C``, ``x``) and of ``conv``, its columns of
        ``out_proj`` (whose bias rank 0 alone adds); the tensor itself without tensor
        parallelism."""
        if parallel_state.tp_size() == 1:
            return tensor
        first, width, hidden = self.first_channel, self.width, self.hidden_size
        if leaf.startswith("in_proj."):
            if tensor.shape[0] != 3 * hidden:
                raise ValueError(
                    f"checkpoint tensor {what or leaf!r} has {tensor.shape[0]} rows, expected "
                    f"{3 * hidden} (does config.json match the weights?)"
                )
            parts = tensor.split(hidden)
            return torch.cat([part[first : first + width] for part in parts])
        if leaf.startswith("conv."):
            return tensor[first : first + width]
        if leaf == "out_proj.weight":
            return tensor[:, first : first + width]
        if leaf == "out_proj.bias":  # added once, after the sum over the ranks
            return tensor if parallel_state.tp_rank() == 0 else torch.zeros_like(tensor)
        return tensor

    def state_specs(self, prefix: str, dtype: torch.dtype) -> list[RequestStateSpec]:
        """This layer's per-request tensor: the conv window ``[hidden, L - 1]`` (this rank's
        channels) in ``dtype`` (the model's) unless --mamba-cache-dtype says otherwise
        (``kind`` ``"conv"``)."""
        shape = (self.width, self.kernel_size - 1)
        return [RequestStateSpec(f"{prefix}.conv", shape, dtype, kind="conv")]

    def graph_capture_blocker(self) -> str | None:
        return "short-conv layers read the step's request boundaries on the host (no graphs yet)"

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        metadata = ctx.attn_metadata
        num_reqs = metadata.num_reqs
        bounds = metadata.query_start_loc_cpu.tolist()[: num_reqs + 1]
        num_tokens = bounds[-1]
        k, width = self.kernel_size, self.width
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
        conv_out, new_states = packed_causal_conv(self.conv, states, bx, lengths)
        if pool is not None:
            pool.index_copy_(0, slots, new_states.to(pool.dtype))

        # (under tensor parallelism: each rank's channels' share, summed over the group)
        out = parallel_state.all_reduce(self.out_proj(C * conv_out))
        if num_tokens < hidden_states.shape[0]:  # padding rows past the step's tokens
            out = torch.cat([out, out.new_zeros(hidden_states.shape[0] - num_tokens, out.shape[1])])
        return out
