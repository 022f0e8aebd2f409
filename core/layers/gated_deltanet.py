"""Gated DeltaNet: Qwen3-Next's linear-attention layer (HF's ``Qwen3NextGatedDeltaNet``).

Per token: ``in_proj_qkvz`` gives, for each of ``num_k_heads`` groups, a query and a key
(``k_head_dim``), and the values and output gates ``z`` of the group's ``num_v_heads /
num_k_heads`` value heads (``v_head_dim``); ``in_proj_ba`` gives each value head's ``b``
(write strength ``beta = sigmoid(b)``) and ``a`` (decay ``g = -exp(A_log) * softplus(a +
dt_bias)``). Queries, keys and values go through a depthwise causal conv1d (window
``conv_kernel``, SiLU), then the gated delta rule (:mod:`chassis.core.layers.
gated_delta_rule`) with L2-normalized queries and keys, each query/key head shared by its
group's value heads; then an RMSNorm per value head gated by ``silu(z)`` and ``out_proj``.

Each request carries two tensors across steps (:meth:`GatedDeltaNet.state_specs`): the last
``conv_kernel - 1`` conv inputs ``[conv_dim, conv_kernel - 1]`` and the delta-rule state
``[num_v_heads, k_head_dim, v_head_dim]``, stored in the model dtype unless
``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` say otherwise (as vLLM; the delta rule
computes in float32: a 16-bit state is widened when read and rounded when written), read
from and written back to the request's slot (``ctx.state_slots``) as the Mamba2 mixer does.
In a step, the requests with one token (decodes) run as one batch; the others (prefill
chunks) as another: the packed conv (:mod:`chassis.core.layers.causal_conv`), then the delta
rule chunk by chunk over the requests padded to one length (or, with ``use_reference``,
request by request: a conv1d over the state and the tokens, the delta rule token by
token).

Under tensor parallelism each rank keeps whole groups of key and value heads
(:mod:`chassis.core.layers.gated_deltanet_shard`): the layer is built at the local sizes, its
state tensors are the local heads', and ``out_proj``'s partial outputs are summed over the
group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.causal_conv import packed_causal_conv
from chassis.core.layers.gated_delta_rule import (
    delta_rule_chunked_varlen,
    delta_rule_recurrence,
    delta_rule_step,
    l2_normalize,
)
from chassis.core.layers.gated_deltanet_shard import gated_deltanet_shard
from chassis.core.layers.step_split import step_split
from chassis.core.request_state_cache import RequestStateSpec


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The layer's shapes (Qwen3-Next's ``linear_*`` config fields)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    norm_eps: float
    #: tokens per chunk of the prefill path's delta rule (HF's pure-torch default)
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.num_k_heads < 1 or self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @classmethod
    def from_config(cls, hf_config: Any) -> GatedDeltaNetSpec:
        """Read ``linear_*`` and ``rms_norm_eps``; a ``hidden_act`` other than ``silu`` (the
        conv's activation) is a ``ValueError``."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by Gated DeltaNet (only silu)")
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_k_heads=int(hf_config.linear_num_key_heads),
            num_v_heads=int(hf_config.linear_num_value_heads),
            k_head_dim=int(hf_config.linear_key_head_dim),
            v_head_dim=int(hf_config.linear_value_head_dim),
            conv_kernel=int(hf_config.linear_conv_kernel_dim),
            norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: queries, keys and values."""
        return 2 * self.key_dim + self.value_dim

    @property
    def heads_per_group(self) -> int:
        """Value heads per query/key head."""
        return self.num_v_heads // self.num_k_heads


class NormThenGate(nn.Module):
    """``weight * rmsnorm(y) * silu(z)`` over the last dimension (one value head): the
    statistics in float32, cast back before the weight, the gate in float32, as HF's
    ``Qwen3NextRMSNormGated`` (the norm before the gate, unlike Mamba2's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y32 = y.float()
        y32 = y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y32.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; parameters named as HF's (``in_proj_qkvz``, ``in_proj_ba``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``).

    ``state_index`` is the position of this layer's conv state in the model's
    ``request_state_specs`` (the delta-rule state follows).
    ``forward(hidden [T, hidden_size], ctx) -> [T, hidden_size]``.

    Under tensor parallelism ``spec`` is this rank's share (``full_spec`` the checkpoint's),
    the checkpoint's whole tensors load through :meth:`checkpoint_part`, and :meth:`forward`
    returns ``out_proj``'s output summed over the group.
    """

    def __init__(self, spec: GatedDeltaNetSpec, state_index: int) -> None:
        super().__init__()
        self.shard = gated_deltanet_shard(spec, parallel_state.tp_size(), parallel_state.tp_rank())
        #: the whole layer's shapes (the checkpoint's), and this rank's share of them
        self.full_spec = spec
        spec = self.spec = self.shard.local
        self.state_index = state_index
        #: run the delta rule token by token per request (the reference) instead of chunked
        self.use_reference = False
        s = spec
        self.in_proj_qkvz = nn.Linear(s.hidden_size, 2 * s.key_dim + 2 * s.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(s.hidden_size, 2 * s.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = NormThenGate(s.v_head_dim, s.norm_eps)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False)

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """This rank's part of the checkpoint's whole tensor ``leaf`` of this layer
        (``in_proj_qkvz.weight``, ``A_log``, ...; ``what``, the checkpoint name, for errors);
        the tensor itself without tensor parallelism."""
        return self.shard.checkpoint_part(leaf, tensor, what or leaf)

    def state_specs(self, prefix: str, dtype: torch.dtype) -> list[RequestStateSpec]:
        """This layer's per-request tensors: the conv window (``kind="conv"``) and the
        delta-rule state (``kind="ssm"``), in ``dtype`` (the model's, as vLLM) unless
        --mamba-cache-dtype / --mamba-ssm-cache-dtype say otherwise; the delta rule runs in
        float32 either way."""
        s = self.spec
        return [
            RequestStateSpec(f"{prefix}.conv", (s.conv_dim, s.conv_kernel - 1), dtype, kind="conv"),
            RequestStateSpec(
                f"{prefix}.recurrent",
                (s.num_v_heads, s.k_head_dim, s.v_head_dim),
                dtype,
                kind="ssm",
            ),
        ]

    def graph_capture_blocker(self) -> str | None:
        return "Gated DeltaNet layers read the step's request boundaries on the host (no graphs)"

    def _project(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` -> conv input ``[T, conv_dim]`` (queries, keys, values), gates
        ``z [T, v_heads, v_head_dim]``, ``b`` and ``a`` ``[T, v_heads]``, from HF's layout
        (the projections grouped by query/key head)."""
        s = self.spec
        num_tokens = hidden_states.shape[0]
        per_group = s.heads_per_group * s.v_head_dim
        qkvz = self.in_proj_qkvz(hidden_states).view(num_tokens, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.k_head_dim, s.k_head_dim, per_group, per_group], dim=-1)
        ba = self.in_proj_ba(hidden_states).view(num_tokens, s.num_k_heads, -1)
        b, a = ba.split([s.heads_per_group, s.heads_per_group], dim=-1)
        mixed = torch.cat(
            [q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)],
            dim=-1,
        )
        return (
            mixed,
            z.reshape(num_tokens, s.num_v_heads, s.v_head_dim),
            b.reshape(num_tokens, s.num_v_heads),
            a.reshape(num_tokens, s.num_v_heads),
        )

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[T, conv_dim]`` -> float32 ``q``, ``k`` ``[T, v_heads, k_head_dim]``
        (normalized, ``q`` scaled, repeated over each group's value heads) and ``v [T,
        v_heads, v_head_dim]``."""
        s = self.spec
        num_tokens = conv_out.shape[0]
        q, k, v = conv_out.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalize(q.reshape(num_tokens, s.num_k_heads, s.k_head_dim)) * s.k_head_dim**-0.5
        k = l2_normalize(k.reshape(num_tokens, s.num_k_heads, s.k_head_dim))
        if s.heads_per_group > 1:
            q = q.repeat_interleave(s.heads_per_group, dim=1)
            k = k.repeat_interleave(s.heads_per_group, dim=1)
        return q, k, v.reshape(num_tokens, s.num_v_heads, s.v_head_dim)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.spec
        dtype = hidden_states.dtype
        metadata = ctx.attn_metadata
        num_reqs = metadata.num_reqs
        bounds = metadata.query_start_loc_cpu.tolist()
        num_tokens = bounds[num_reqs]
        mixed, z, b, a = self._project(hidden_states[:num_tokens])
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        if ctx.request_states is None or ctx.state_slots is None:
            # memory profiling: every request starts from zeros and nothing is kept
            slots = None
            conv_states = mixed.new_zeros(num_reqs, s.conv_dim, s.conv_kernel - 1)
            states = mixed.new_zeros(
                num_reqs, s.num_v_heads, s.k_head_dim, s.v_head_dim, dtype=torch.float32
            )
        else:
            slots = ctx.state_slots
            conv_pool = ctx.request_states[self.state_index]
            state_pool = ctx.request_states[self.state_index + 1]
            conv_states = conv_pool[slots].to(mixed.dtype)
            states = state_pool[slots].float()

        if num_tokens == num_reqs:  # one token per request: every request in one batch
            out, new_conv, new_states = self._decode(conv_states, states, mixed, g, beta)
        else:
            # requests with one token (decodes) in one batch, the others in another
            out = mixed.new_empty(num_tokens, s.num_v_heads, s.v_head_dim, dtype=torch.float32)
            new_conv = torch.empty_like(conv_states)
            new_states = torch.empty_like(states)
            split = step_split(tuple(bounds[: num_reqs + 1]), mixed.device)
            if len(split.single_rows):
                rows, tokens = split.single_rows, split.single_tokens
                out[tokens], new_conv[rows], new_states[rows] = self._decode(
                    conv_states[rows], states[rows], mixed[tokens], g[tokens], beta[tokens]
                )
            if self.use_reference:
                for i in split.many:
                    a, b = bounds[i], bounds[i + 1]
                    out[a:b], new_conv[i], new_states[i] = self._prefill_reference(
                        conv_states[i], states[i], mixed[a:b], g[a:b], beta[a:b]
                    )
            elif split.many:
                rows, tokens = split.many_rows, split.many_tokens
                out[tokens], new_conv[rows], new_states[rows] = self._prefill(
                    conv_states[rows],
                    states[rows],
                    mixed[tokens],
                    g[tokens],
                    beta[tokens],
                    split.many_lengths,
                )
        if slots is not None:
            conv_pool.index_copy_(0, slots, new_conv.to(conv_pool.dtype))
            state_pool.index_copy_(0, slots, new_states.to(state_pool.dtype))
        normed = self.norm(out.to(dtype), z)
        # (under tensor parallelism: each rank's heads' share, summed over the group)
        result = parallel_state.all_reduce(self.out_proj(normed.reshape(num_tokens, s.value_dim)))
        if result.shape[0] < hidden_states.shape[0]:  # padding rows past the step's tokens
            pad = hidden_states.shape[0] - num_tokens
            result = torch.cat([result, result.new_zeros(pad, result.shape[1])])
        return result

    def _decode(
        self,
        conv_states: torch.Tensor,
        states: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of ``R`` requests: ``conv_states [R, conv_dim, K - 1]``,
        ``states [R, H, k_dim, v_dim]``, ``mixed [R, conv_dim]``, ``g``/``beta`` ``[R, H]``;
        returns ``(o [R, H, v_dim], new conv states, new states)``."""
        window = torch.cat([conv_states, mixed[:, :, None]], dim=-1)  # [R, conv_dim, K]
        conv_out = F.silu((window * self.conv1d.weight[:, 0, :]).sum(-1))
        q, k, v = self._qkv(conv_out)
        o, new_states = delta_rule_step(states, q, k, v, g, beta)
        return o, window[:, :, 1:], new_states

    def _prefill(
        self,
        conv_states: torch.Tensor,
        states: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lengths: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Several requests' tokens at once: ``conv_states [R, conv_dim, K - 1]``, ``states
        [R, H, k_dim, v_dim]``, ``mixed [T, conv_dim]`` and ``g``/``beta`` ``[T, H]`` with
        request ``r``'s ``lengths[r]`` tokens contiguous; returns ``(o [T, H, v_dim], new
        conv states, new states)``.

        The conv is :func:`~chassis.core.layers.causal_conv.packed_causal_conv` (one conv1d
        over every request's state and tokens), the delta rule
        :func:`~chassis.core.layers.gated_delta_rule.delta_rule_chunked_varlen` (the
        requests padded to the longest, in one batch)."""
        conv_out, new_conv = packed_causal_conv(self.conv1d, conv_states, mixed, lengths)
        q, k, v = self._qkv(F.silu(conv_out))
        o, new_states = delta_rule_chunked_varlen(
            states, q, k, v, g, beta, lengths, self.spec.chunk_size
        )
        return o, new_conv, new_states

    def _prefill_reference(
        self,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference for one request's ``L`` tokens: ``conv_state [conv_dim, K - 1]``,
        ``state [H, k_dim, v_dim]``, ``mixed [L, conv_dim]``, ``g``/``beta`` ``[L, H]``; a
        conv1d over the state and the tokens, then the token-by-token delta rule; returns
        ``(o [L, H, v_dim], new conv state, new state)``."""
        s = self.spec
        window = torch.cat([conv_state, mixed.T], dim=-1)  # [conv_dim, K - 1 + L]
        conv_out = F.conv1d(window[None], self.conv1d.weight, groups=s.conv_dim)[0].T
        q, k, v = self._qkv(F.silu(conv_out))
        o, new_state = delta_rule_recurrence(state, q, k, v, g, beta)
        return o, window[:, -(s.conv_kernel - 1) :], new_state
