"""Multimodal RoPE (M-RoPE) as the Qwen2-VL, Qwen2.5-VL and Qwen3-VL language models apply it.

Each token has three position components (temporal, height, width), and each of the
``rotary_dim / 2`` frequencies is turned by one of them, in one of two layouts:

* **sections** (Qwen2-VL, Qwen2.5-VL; HF's ``Qwen2VLRotaryEmbedding``): the frequencies are
  split into consecutive ``mrope_section`` groups (``[16, 24, 24]`` for head_dim 128); group
  ``i`` is turned by component ``i``;
* **interleaved** (``mrope_interleaved``, Qwen3-VL; HF's ``Qwen3VLTextRotaryEmbedding``):
  frequency ``j`` is turned by the height component when ``j % 3 == 1`` and
  ``j < 3 * mrope_section[1]``, by the width one when ``j % 3 == 2`` and
  ``j < 3 * mrope_section[2]``, else by the temporal one (``[24, 20, 20]`` for head_dim 128).

The rotation is otherwise :class:`~chassis.core.layers.rotary.RotaryEmbedding`'s: rotate-half,
or GPT-J's pairs with ``"interleaved"`` (GLM-4.1V, whose sections choose the frequency of
each pair). A text
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
    says which frequencies each component turns, as consecutive groups or, with
    ``params["mrope_interleaved"]``, interleaved (see the module docstring); a ``ValueError``
    when they do not add up. GPT-J's interleaved rotation (``params["interleaved"]``, a
    different thing: GLM-4.1V's) rotates pairs ``(2j, 2j + 1)`` by frequency ``j``, chosen
    by section as in the rotate-half layout (HF's ``repeat_interleave(2)`` of the sections'
    frequencies).
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
        self.mrope_section = section
        self.mrope_interleaved = bool(params.get("mrope_interleaved", False))
        # frequency j's component (0 temporal, 1 height, 2 width): [rotary_dim / 2]
        component = section_components(section, self.mrope_interleaved)
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
        layout = ", mrope_interleaved" if self.mrope_interleaved else ""
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}{layout}"


def section_components(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position component (0 temporal, 1 height, 2 width) turns each of the
    ``sum(section)`` frequencies: ``[sum(section)]`` int64 on the host."""
    if not interleaved:
        return torch.repeat_interleave(
            torch.arange(3, device="cpu"), torch.tensor(section, device="cpu")
        )
    j = torch.arange(sum(section), device="cpu")
    component = torch.zeros_like(j)
    component[(j % 3 == 1) & (j < 3 * section[1])] = 1
    component[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return component
