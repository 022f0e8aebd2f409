"""``LoRALinear``: a linear layer plus the deltas of the adapters in the batch, per token.

The layer keeps ``max_loras`` device *slots*; slot ``l`` holds one adapter's ``A`` and
``B * scaling`` (zero-padded to ``max_rank``). A step's :class:`LoRAStepState` says, per
token, which slot applies (a one-hot row; all zeros for a token without an adapter). Then

    y = base(x) + sum_l mask[:, l] * B_l (A_l x)

is computed for every slot at once, with dense matmuls and no host synchronisation:
``h = x @ A_all^T`` (``[T, slices * slots * rank]``, one matmul for every slice), ``h *= mask``,
then per output slice ``y[:, rows] += h_slice @ B^T`` (an in-place ``addmm``). A merged layer
(Q/K/V, or gate/up) holds one ``A`` and one ``B`` per slice: each HF projection it merges is
adapted on its own rows. On the CPU these few small ops per layer are what an adapter costs
(tests/perf/lora_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoRAStepState:
    """What every :class:`LoRALinear` of a model reads in a forward (shared, set per step).

    :param token_mask: ``[max_tokens, max_loras]`` float32: row ``t`` is the
        one-hot slot of token ``t``'s adapter (zeros: none); a forward of ``T`` tokens
        reads the first ``T`` rows
    :param active: whether any token of the step has an adapter; when not, the layers skip
        the adapter matmuls altogether
    """

    token_mask: torch.Tensor
    active: bool = False


def layer_device(layer: nn.Module) -> torch.device:
    """The device of a linear layer's tensors: its weight's, or for a layer without one
    (:class:`~chassis.core.layers.int4_linear.Int4Linear` holds packed buffers) its first
    buffer's."""
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(iter(layer.buffers())).device


class LoRALinear(nn.Module):
    """``base_layer`` (an ``nn.Linear``, what a platform swapped it for, or an
    :class:`~chassis.core.layers.int4_linear.Int4Linear` running the packed 4-bit kernel)
    with LoRA slots: the adapters' deltas are added to whatever the base layer computes.

    :param base_layer: the wrapped layer; ``in_features`` / ``out_features`` describe it
    :param slices: ``(first output row, rows)`` of each adaptable projection the layer holds
        (one for a plain projection, three for a merged Q/K/V)
    :param state: the step state shared by all wrappers of the model
    """

    def __init__(
        self,
        base_layer: nn.Module,
        slices: list[tuple[int, int]],
        state: LoRAStepState,
        max_loras: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features = int(base_layer.in_features)
        self.out_features = int(base_layer.out_features)
        self.slices = list(slices)
        self.state = state
        self.max_loras = max_loras
        self.max_rank = max_rank
        # Adapters compute in float32 whatever the model's dtype: exact to the adapter file,
        # and at these small shapes no slower (on the CPU twice as fast as bfloat16 matmuls).
        factory = {"dtype": torch.float32, "device": layer_device(base_layer)}
        num_slices = len(self.slices)
        #: ``[slices, slots, rank, in]``: the A matrices of every slice and slot (slice-major,
        #: so that each slice's part of ``x A^T`` is a column range the B matmul reads as is)
        self.register_buffer(
            "lora_a", torch.zeros(num_slices, max_loras, max_rank, self.in_features, **factory)
        )
        # One B per slice, ``[rows, slots, rank]``: slices differ in rows (Q vs K/V).
        for index, (_, rows) in enumerate(self.slices):
            self.register_buffer(
                f"lora_b_{index}", torch.zeros(rows, max_loras, max_rank, **factory)
            )

    def lora_b(self, index: int) -> torch.Tensor:
        """The B buffer of slice ``index``: ``[rows, slots, rank]``."""
        return getattr(self, f"lora_b_{index}")

    def set_slot(
        self, slot: int, index: int, a: torch.Tensor | None, b: torch.Tensor | None
    ) -> None:
        """Put an adapter's ``A [r, in]`` and pre-scaled ``B [rows, r]`` for slice ``index``
        into ``slot`` (zero-padded to ``max_rank``); ``None`` clears the slice (an adapter
        that leaves this projection as it is)."""
        slot_a = self.lora_a[index, slot]
        slot_b = self.lora_b(index)[:, slot]
        slot_a.zero_()
        slot_b.zero_()
        if a is None or b is None:
            return
        rank = a.shape[0]
        slot_a[:rank].copy_(a)
        slot_b[:, :rank].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if not self.state.active:
            return out
        num_tokens = x.shape[0]
        width = self.max_loras * self.max_rank
        # [T, slices, slots, rank]: every slot's A x, kept only for each token's own slot
        h = F.linear(x.float(), self.lora_a.view(-1, self.in_features))
        h.view(num_tokens, len(self.slices), self.max_loras, self.max_rank).mul_(
            self.state.token_mask[:num_tokens, None, :, None]
        )
        # float32 deltas of every slice, added to the output at once (rounded once to the
        # model's dtype); a float32 model's output takes them directly
        delta = out if out.dtype == torch.float32 else torch.zeros_like(out, dtype=torch.float32)
        for index, (start, rows) in enumerate(self.slices):
            delta[:, start : start + rows].addmm_(
                h[:, index * width : (index + 1) * width], self.lora_b(index).view(rows, width).t()
            )
        if delta is not out:
            out.add_(delta)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"slices={self.slices}, max_loras={self.max_loras}, max_rank={self.max_rank}"
        )
