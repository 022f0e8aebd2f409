"""Torch references of the fused decoder-layer ops (the specification the kernels follow).

The Triton kernels of :mod:`chassis.core.layers.triton_ops` compute the same values in the
same rounding order (HF transformers' order), so results agree to rounding. Which kernel the
model's layers run is the platform's choice (``Platform.layer_kernels()``, see
:mod:`chassis.core.layers.kernels`), not this module's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "qk_norm_rotary_embedding_ref",
    "rms_norm_ref",
    "rotary_embedding_ref_",
    "silu_and_mul_ref",
]


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding ``residual``.

    Without ``residual``: ``weight * normalize(x)``. With it: ``s = x + residual`` (rounded to
    ``x.dtype``) and ``(weight * normalize(s), s)``. The statistics are float32; the normalized
    value is rounded to ``x.dtype`` before the scale, and the result is ``x.dtype``.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * d]`` -> ``[..., d]``: ``silu(x[..., :d]) * x[..., d:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_ref_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query``/``key`` in place by ``positions`` and return them.

    :param positions: ``[T]`` integer positions
    :param query: ``[T, Hq * head_dim]`` or ``[T, Hq, head_dim]``
    :param key: ``[T, Hk * head_dim]`` or ``[T, Hk, head_dim]``
    :param cos_cache: ``[max_position, rot_dim / 2]`` (float32), ``cos(pos * inv_freq)``
    :param sin_cache: same shape, ``sin(pos * inv_freq)``
    :param head_dim: size of a head; the first ``rot_dim <= head_dim`` dims are rotated
    :param is_neox: pair dim ``i`` with ``i + rot_dim / 2`` (Llama, Qwen: HF "rotate half");
        else pair ``2i`` with ``2i + 1`` (GPT-J)
    Computed in float32, stored in the tensors' dtype.
    """
    half = cos_cache.shape[-1]
    if 2 * half > head_dim:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {head_dim}")
    cos = cos_cache[positions].float().unsqueeze(1)  # [T, 1, half]
    sin = sin_cache[positions].float().unsqueeze(1)
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim)
        rot = heads[..., : 2 * half].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if is_neox:
            rotated = torch.cat((r1, r2), dim=-1)
        else:
            rotated = torch.stack((r1, r2), dim=-1).flatten(-2)
        heads[..., : 2 * half] = rotated.to(x.dtype)
    return query, key


def qk_norm_rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of ``query [T, Hq, D]`` and ``key [T, Hk, D]``, then rotate-half RoPE
    of the whole head, as Qwen3's attention does (HF's rounding order). Returns new tensors.

    The norm is :func:`rms_norm_ref` over ``D`` with ``q_weight`` / ``k_weight`` ``[D]``. The
    rotation runs in the tensors' dtype with cos/sin (``[max_position, D / 2]``, float32)
    rounded to it first: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, each product
    rounded before the sum.
    """
    cos = cos_cache[positions].unsqueeze(1).to(query.dtype)  # [T, 1, D / 2]
    sin = sin_cache[positions].unsqueeze(1).to(query.dtype)
    rotated = []
    for x, weight in ((query, q_weight), (key, k_weight)):
        normed = rms_norm_ref(x, weight, eps)
        x1, x2 = normed.chunk(2, dim=-1)
        rotated.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return rotated[0], rotated[1]
