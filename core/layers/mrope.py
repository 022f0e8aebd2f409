"""Multimodal RoPE (M-RoPE) as Qwen2-VL and Qwen2.5-VL's language model applies it.

Each token has three position components (temporal, height, width). The ``rotary_dim / 2``
frequencies are split into ``mrope_section`` groups (``[16, 24, 24]`` for head_dim 128); group
``i`` is turned by component ``i % 3`` (HF's ``Qwen2VLRotaryEmbedding``), and the rotation
is otherwise :class:`~chassis.core.layers.rotary.RotaryEmbedding`'s rotate-half one. A text
token has three equal components, which turns every frequency by that one position: plain
RoPE. So positions ``[T]`` (all three equal) take the plain path unchanged, platform kernels
included, and only positions ``[3, T]`` take the per-section path here (torch code; the
rows of a step with image tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.core.layers.rotary import RotaryEmbedding

#: HF's ``mrope_section`` when the config names none (Qwen2-VL's, for head_dim 128)
DEFAULT_MROPE_SECTION = (16, 24, 24)


class MRotaryEmbedding(RotaryEmbedding):
    """:class:`RotaryEmbedding` that also takes positions ``[3, T]`` (M-RoPE).

    ``params["mrope_section"]`` (three numbers of frequencies, summing to ``rotary_dim / 2``)
    says which frequencies each component turns; a ``ValueError`` when they do not add up.
    The interleaved layout (Qwen3-VL's ``mrope_interleaved``) is not this one and is refused.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        *,
        context_len: int | None = None,
    ) -> None:
        super().__init__(head_dim, max_position, params, context_len=context_len)
        section = tuple(int(n) for n in params.get("mrope_section") or DEFAULT_MROPE_SECTION)
        if len(section) != 3 or sum(section) != self.rotary_dim // 2 or min(section) < 0:
            raise ValueError(
                f"mrope_section {list(section)} must be three numbers of frequencies adding up "
                f"to rotary_dim / 2 = {self.rotary_dim // 2}; does config.json match the model?"
            )
        if self.interleaved or params.get("mrope_interleaved"):
            raise ValueError("interleaved M-RoPE (mrope_interleaved) is not supported here")
        self.mrope_section = section
        # frequency j's component (0 temporal, 1 height, 2 width): [rotary_dim / 2]
        component = torch.repeat_interleave(
            torch.arange(3, device="cpu"), torch.tensor(section, device="cpu")
        )
        self.register_buffer(
            "section_component", component.to(self.cos_cache.device), persistent=False
        )

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RotaryEmbedding.forward` for ``positions [T]``; for ``[3, T]``, each
        frequency turned by its section's component (the torch code)."""
        if positions.dim() == 1:
            return super().forward(positions, query, key, qk_norms)
        if qk_norms is not None:
            query, key = qk_norms[0](query), qk_norms[1](key)
        # the torch code, as the 1-D path's: its memo keeps one table gather per step for
        # every layer (the same positions tensor), here through :meth:`_cos_sin`
        return self.forward_reference(positions, query, key)

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RotaryEmbedding._cos_sin`, and for ``[3, T]`` positions
        :meth:`mrope_cos_sin`."""
        if positions.dim() == 1:
            return super()._cos_sin(positions, dtype)
        return self.mrope_cos_sin(positions, dtype)

    def mrope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim / 2]`` cos and sin for positions ``[3, T]``, in ``dtype``:
        frequency ``j`` at the position component of its section."""
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [3, T]; got {tuple(positions.shape)}")
        # [3, T, D/2] tables at each component's positions; pick row section_component[j]
        # for frequency j (a gather over the first dimension)
        index = self.section_component.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index)[0]
        sin = self.sin_cache[positions].gather(0, index)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}"
