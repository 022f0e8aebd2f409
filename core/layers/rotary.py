"""Rotary position embedding (RoPE) as Llama and Qwen use it, with Llama-3 frequency scaling.

Rotation is the "rotate half" (GPT-NeoX) layout of HF transformers: dimension ``i`` pairs with
``i + head_dim / 2``. cos/sin for every position are computed once, in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from chassis.core.layers.kernels import kernels_for
from chassis.core.layers.norm import RMSNorm

#: rope types this module implements (HF ``rope_parameters["rope_type"]``)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least ``rope_theta`` and ``rope_type``.

    transformers 5.x keeps them in ``config.rope_parameters``; 4.x kept ``config.rope_theta``
    and an optional ``config.rope_scaling`` dict (whose type key was once ``"type"``). Both are
    read, so a config from either version works.
    """
    params: dict[str, Any] = {}
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy_scaling, dict):
        params.update(legacy_scaling)
    new_style = getattr(hf_config, "rope_parameters", None)
    if isinstance(new_style, dict):
        params.update(new_style)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair inverse frequencies ``[head_dim / 2]`` (float32), after any scaling."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened query/key tensors at given positions.

    :param head_dim: size of each head; the whole head is rotated
    :param max_position: positions ``0 .. max_position - 1`` are precomputed
    :param params: from :func:`rope_parameters`
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim; got {head_dim}")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported by RotaryEmbedding")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = _inverse_frequencies(head_dim, params)
        # Computed in float32 on the CPU (as HF does), then moved to the current default
        # device. Explicit dtypes: the tables must not follow the model's default dtype.
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        device = torch.empty(0).device
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, Hq, D]`` and ``key [T, Hk, D]`` by ``positions [T]``.

        ``qk_norms``: ``(q_norm, k_norm)``, per-head RMSNorms over ``D`` applied to query and
        key first (Qwen3). A platform kernel may fuse them with the rotation when both are
        :class:`RMSNorm` itself; other modules (subclasses included) are called as they are.

        Computed in the input dtype, as HF does. Platform kernels rotate the given tensors in
        place and return them; the torch path returns new tensors. Callers must not rely on
        either: use the returned tensors and treat the inputs as consumed.
        """
        kernels = kernels_for(query)
        if qk_norms is not None:
            q_norm, k_norm = qk_norms
            fused = getattr(kernels, "qk_norm_rotary_embedding_", None)
            if fused is not None and _fusable(q_norm, k_norm, query, key):
                return fused(
                    positions,
                    query,
                    key,
                    q_norm.weight,
                    k_norm.weight,
                    q_norm.eps,
                    self.cos_cache,
                    self.sin_cache,
                )
            query, key = q_norm(query), k_norm(key)
        if kernels is None:
            return self.forward_reference(positions, query, key)
        kernels.rotary_embedding_(positions, query, key, self.cos_cache, self.sin_cache)
        return query, key

    def forward_reference(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch implementation (new tensors; what platform kernels are tested against)."""
        if qk_norms is not None:
            query, key = qk_norms[0].forward_reference(query), qk_norms[1].forward_reference(key)
        if torch.compiler.is_compiling():
            # No memo by tensor identity in traced code (it would become a guard); the
            # compiler shares the gather between layers itself.
            cos, sin = self._cos_sin(positions, query.dtype)
        else:
            memo = self._memo
            if memo is None or memo[0] is not positions or memo[1] != query.dtype:
                memo = self._memo = (positions, query.dtype, *self._cos_sin(positions, query.dtype))
            cos, sin = memo[2], memo[3]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D / 2]`` cos and sin at ``positions``, in ``dtype``."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In the input dtype with tables cast to it, as HF transformers does.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _fusable(q_norm: RMSNorm, k_norm: RMSNorm, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether one fused kernel computes what the two norms and the rotation do: both norms
    are this package's RMSNorm (a subclass may compute something else), their weights are in
    the tensors' dtype (else RMSNorm runs its torch code) and they share one eps."""
    return (
        type(q_norm) is RMSNorm
        and type(k_norm) is RMSNorm
        and q_norm.weight.dtype == query.dtype == key.dtype == k_norm.weight.dtype
        and q_norm.eps == k_norm.eps
    )
