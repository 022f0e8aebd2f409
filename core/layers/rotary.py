"""Rotary position embedding (RoPE) as Llama, Qwen and Phi-3 use it.

Rotation is the "rotate half" (GPT-NeoX) layout of HF transformers: dimension ``i`` pairs with
``i + rotary_dim / 2``. With a ``partial_rotary_factor`` below 1 (Phi-4-mini) only the first
``rotary_dim = head_dim * factor`` dimensions of each head rotate; the rest pass through.
cos/sin for every position are computed once, in float32.

Layout ``interleaved`` (GPT-J's "rotate every two", HF's GLM-4): with ``"interleaved": True``
in the parameters (chassis's own key, set by the architecture: no HF config names the
layout), dimension ``2i`` pairs with ``2i + 1`` instead, at the same frequency ``i``. Only the
torch code implements it (:func:`rotate_interleaved`); the platform kernels, which rotate
whole heads in the rotate-half layout, are never called for it.

Frequency scaling: ``linear``, ``llama3`` (Llama 3.1), ``longrope`` (Phi-3/3.5/4-mini),
``yarn`` (gpt-oss; :func:`_yarn_inverse_frequencies`, cos and sin multiplied by
:func:`yarn_attention_factor`, both as HF computes them, for every position alike) and
``ntk_alpha`` (Hunyuan's fixed-``alpha`` NTK scaling, which only raises the base to
``rope_theta * alpha ** (rotary_dim / (rotary_dim - 2))``; the checkpoints label it
``dynamic`` with an ``alpha``, and HF's Hunyuan renames it ``ntk_alpha`` as the architecture
here does: HF's sequence-length-dependent ``dynamic`` type stays unsupported).
LongRoPE divides each frequency by a per-dimension factor and multiplies cos and sin by an
attention factor. HF transformers uses ``short_factor`` while a sequence fits in
``original_max_position_embeddings`` and ``long_factor`` for *all* its positions once it is
longer (its ``generate`` recomputes the whole cache when a sequence crosses that length). A
paged cache cannot rotate cached keys again, so here one set serves every sequence, chosen
by the longest context served (``context_len``, i.e. ``--max-model-len``): the short factors
when it fits in the original length, which is then exactly HF's result for every sequence;
else the long factors, exactly HF's result for every sequence longer than the original length
and a difference for shorter ones. vLLM makes the same choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from chassis.core.layers.kernels import kernels_for
from chassis.core.layers.norm import RMSNorm

#: rope types this module implements (HF ``rope_parameters["rope_type"]``)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn", "ntk_alpha")
#: rope types whose ``original_max_position_embeddings`` a top-level config field overrides
#: (as HF's ``standardize_rope_params`` does: Phi-3 keeps the pretraining length there)
_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least ``rope_theta`` and ``rope_type``.

    transformers 5.x keeps them in ``config.rope_parameters``; 4.x kept ``config.rope_theta``
    and an optional ``config.rope_scaling`` dict (whose type key was once ``"type"``). Both are
    read, so a config from either version works. A top-level ``partial_rotary_factor`` is
    moved in (Phi-4-mini's 4.x config), Phi-3's old type name ``"su"`` reads as
    ``"longrope"``, and for the scaled types a top-level ``original_max_position_embeddings``
    takes precedence, as in HF. ``longrope`` and ``yarn`` without ``factor`` get
    ``max_position_embeddings / original_max_position_embeddings`` (HF's default; the
    original length defaults to ``max_position_embeddings``).
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
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if params.get("partial_rotary_factor") is None and partial is not None:
        params["partial_rotary_factor"] = partial
    original_max = getattr(hf_config, "original_max_position_embeddings", None)
    if params["rope_type"] in _ORIGINAL_MAX_TYPES and isinstance(original_max, int):
        params["original_max_position_embeddings"] = original_max
    if params["rope_type"] in ("longrope", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        if params.get("factor") is None:
            params["factor"] = hf_config.max_position_embeddings / float(
                params["original_max_position_embeddings"]
            )
    return params


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair inverse frequencies ``[rotary_dim / 2]`` (float32), after any scaling
    (``longrope``: :func:`_longrope_inverse_frequencies`)."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type == "ntk_alpha":
        base = ntk_alpha_base(rotary_dim, params)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "ntk_alpha"):
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


def ntk_alpha_base(rotary_dim: int, params: dict[str, Any]) -> float:
    """The RoPE base of ``ntk_alpha`` scaling: ``rope_theta * alpha ** (rotary_dim /
    (rotary_dim - 2))`` (HF's Hunyuan ``compute_ntk_alpha_rope_parameters``, in Python
    floats as there); a ``ValueError`` without a positive ``alpha``."""
    alpha = params.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"rope_type 'ntk_alpha' needs a positive alpha; got {alpha!r}")
    if rotary_dim <= 2:
        raise ValueError(f"rope_type 'ntk_alpha' needs a rotary_dim above 2; got {rotary_dim}")
    return float(params["rope_theta"]) * float(alpha) ** (rotary_dim / (rotary_dim - 2))


def longrope_attention_factor(params: dict[str, Any]) -> float:
    """The factor LongRoPE multiplies cos and sin by: the config's ``attention_factor``, else
    ``sqrt(1 + log(factor) / log(original_max_position_embeddings))`` (1 when ``factor`` <= 1),
    as in HF transformers."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(
        1 + math.log(factor) / math.log(int(params["original_max_position_embeddings"]))
    )


def _yarn_inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN's ``[rotary_dim / 2]`` inverse frequencies (HF's ``_compute_yarn_parameters``,
    in its order of operations so that the float32 values are identical).

    Each frequency blends the original (extrapolation) and the one divided by ``factor``
    (interpolation) with a linear ramp over the dimensions between the correction range
    that ``beta_fast`` and ``beta_slow`` (rotations over ``original_max_position_embeddings``
    positions) give; ``truncate`` (default true) rounds that range outwards to whole
    dimensions.
    """
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    original_max = int(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength makes num_rotations turns over original_max positions
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    pos_freqs = base**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    extrapolation_factor = 1 - torch.clamp(ramp, 0, 1)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by: the config's ``attention_factor``, else
    ``0.1 * ln(factor) + 1`` (1 when ``factor`` <= 1), or with both ``mscale`` and
    ``mscale_all_dim`` set (DeepSeek) the ratio of that formula with each as the log's
    coefficient, as in HF transformers."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(coefficient: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(float(params["mscale"])) / mscale(float(params["mscale_all_dim"]))
    return mscale()


def _longrope_inverse_frequencies(
    rotary_dim: int, params: dict[str, Any], context_len: int
) -> torch.Tensor:
    """LongRoPE's ``[rotary_dim / 2]`` inverse frequencies for sequences up to
    ``context_len``: ``short_factor`` within ``original_max_position_embeddings``, else
    ``long_factor`` (why one set: the module docstring)."""
    base = float(params["rope_theta"])
    for key in ("short_factor", "long_factor"):  # both checked: a bad config fails at once
        factors = params.get(key)
        if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
            got = len(factors) if isinstance(factors, (list, tuple)) else factors
            raise ValueError(
                f"longrope {key} must be a list of {rotary_dim // 2} numbers (rotary_dim / 2); "
                f"got {got!r}: does config.json match the model?"
            )
    use_long = context_len > int(params["original_max_position_embeddings"])
    factors = params["long_factor" if use_long else "short_factor"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    # HF's order of operations, so that the float32 values are identical
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**exponents)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened query/key tensors at given positions.

    :param head_dim: size of each head; its first ``rotary_dim`` dimensions are rotated
        (``head_dim * params["partial_rotary_factor"]``, all of them by default)
    :param max_position: positions ``0 .. max_position - 1`` are precomputed
    :param params: from :func:`rope_parameters`
    :param context_len: the longest sequence served (``--max-model-len``; default
        ``max_position``); LongRoPE picks its factors by it (see the module docstring)
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        *,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        partial = float(params.get("partial_rotary_factor") or 1.0)
        rotary_dim = int(head_dim * partial)
        if not 0 < partial <= 1 or rotary_dim % 2 or rotary_dim == 0:
            raise ValueError(
                f"rotary embedding needs an even, non-zero rotary_dim <= head_dim; head_dim "
                f"{head_dim} with partial_rotary_factor {partial} gives {rotary_dim}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        #: GPT-J's "rotate every two" layout (pairs ``2i, 2i + 1``; the module docstring)
        self.interleaved = bool(params.get("interleaved", False))
        self.max_position = max_position
        # Computed in float32 on the CPU (as HF does), then moved to the current default
        # device. Explicit dtypes: the tables must not follow the model's default dtype.
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        self.context_len = max_position if context_len is None else context_len
        if params["rope_type"] == "longrope":
            inv_freq = _longrope_inverse_frequencies(rotary_dim, params, self.context_len)
            scaling = longrope_attention_factor(params)
        elif params["rope_type"] == "yarn":
            inv_freq = _yarn_inverse_frequencies(rotary_dim, params)
            scaling = yarn_attention_factor(params)
        else:
            inv_freq = _inverse_frequencies(rotary_dim, params)
            scaling = 1.0
        freqs = torch.outer(positions, inv_freq)
        # freqs: [max_position, rotary_dim / 2]; HF scales cos and sin in float32 (by 1 for
        # the types without an attention factor, which changes nothing)
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        device = torch.empty(0).device
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, Hq, D]`` and ``key [T, Hk, D]`` by ``positions [T]``.

        ``qk_norms``: ``(q_norm, k_norm)``, per-head RMSNorms over ``D`` applied to query and
        key first (Qwen3). A platform kernel may fuse them with the rotation when both are
        :class:`RMSNorm` itself; other modules (subclasses included) are called as they are.

        Computed in the input dtype, as HF does. Platform kernels rotate the given tensors in
        place and return them; the torch path returns new tensors. Callers must not rely on
        either: use the returned tensors and treat the inputs as consumed. Partial rotation
        (``rotary_dim < head_dim``) and the interleaved layout always run the torch code: the
        kernels rotate whole heads in the rotate-half layout.
        """
        # the kernels rotate whole heads, halves paired: the other cases are the torch code's
        whole_halves = self.rotary_dim == self.head_dim and not self.interleaved
        kernels = kernels_for(query) if whole_halves else None
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
        if self.interleaved:
            return rotate_interleaved(query, cos, sin), rotate_interleaved(key, cos, sin)
        if self.rotary_dim != self.head_dim:
            return _rotate_partial(query, cos, sin), _rotate_partial(key, cos, sin)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D / 2]`` cos and sin at ``positions``, in ``dtype``."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def extra_repr(self) -> str:
        partial = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        layout = ", interleaved" if self.interleaved else ""
        return f"head_dim={self.head_dim}{partial}{layout}, max_position={self.max_position}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In the input dtype with tables cast to it, as HF transformers does.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The first 2 * cos.shape[-1] dimensions rotate among themselves; the rest pass through.
    rotary_dim = 2 * cos.shape[-1]
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with dimensions ``2i`` and ``2i + 1`` of the first ``2 * cos.shape[-1]``
    rotated by angle ``i`` (``cos``/``sin`` broadcast against ``x[..., ::2]``'s rotated
    part), the rest passed through; computed in the inputs' dtype (HF's GLM-4 order,
    ``x * cos + rotate_every_two(x) * sin``). A model that rounds differently (Cohere2)
    casts before and after."""
    rotary_dim = 2 * cos.shape[-1]
    even, odd = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((rotated.flatten(-2), x[..., rotary_dim:]), dim=-1)


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
