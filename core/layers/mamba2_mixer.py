"""The Mamba2 mixer: a state-space layer in place of attention (Mamba2, Granite 4.0-H,
Bamba, Nemotron-H).

Per token: ``in_proj`` gives the gate ``z``, the conv input ``xBC`` and ``dt``; a depthwise
causal conv1d (window ``d_conv``) with SiLU over ``xBC``, split into ``x`` (heads x
head_dim), ``B`` and ``C`` (groups x d_state); the SSD scan (:mod:`chassis.core.layers.
ssd_scan`); a gated RMSNorm (``y * silu(z)``, normalized per group) and ``out_proj``.
Falcon-H1's options (:class:`Mamba2Spec`): the norm before the gate or no norm, multipliers
on the input and on each part of ``in_proj``'s output, ``out_proj``'s own bias flag.

Each request carries two tensors across steps (:meth:`Mamba2Mixer.state_specs`): the last
``d_conv - 1`` conv inputs ``[conv_dim, d_conv - 1]`` and the SSM state ``[heads, head_dim,
d_state]``, stored in the model dtype unless ``--mamba-cache-dtype`` /
``--mamba-ssm-cache-dtype`` say otherwise (the scan computes in float32). A step's tokens
are packed (request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``); the
layer reads each request's state from its slot (``ctx.state_slots``), which starts zeroed,
and writes it back. The requests with one token in the step (decodes) run as one batch, the
others (prefill chunks) as another: the packed conv (:mod:`chassis.core.layers.causal_conv`)
and the chunked varlen scan (or, with
``use_reference``, request by request: a padded conv1d and the token-by-token scan).

Under tensor parallelism each rank keeps a share of the heads and groups
(:mod:`chassis.core.layers.mamba2_shard`) and the layer's output is summed over the group; a
model loads the checkpoint's whole tensors through :func:`mamba2_checkpoint_part`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.causal_conv import packed_causal_conv
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.layers.ssd_scan import ssd_chunked_varlen, ssd_recurrence, ssd_step
from chassis.core.layers.step_split import step_split
from chassis.core.request_state_cache import RequestStateSpec


@dataclass(frozen=True)
class Mamba2Spec:
    """The mixer's shapes and options (read from each architecture's config fields)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    intermediate_size: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    #: ``out_proj``'s bias when it differs from ``in_proj``'s (Falcon-H1's
    #: ``projectors_bias``); ``None``: ``proj_bias``
    out_proj_bias: bool | None = None
    #: how ``y`` meets the gate ``z`` before ``out_proj``: ``"gate_then_norm"`` (the gated
    #: RMSNorm of ``y * silu(z)``), ``"norm_then_gate"`` (``rmsnorm(y) * silu(z)``) or
    #: ``"gate"`` (``y * silu(z)``, no norm and no ``norm`` parameter)
    gate_norm: str = "gate_then_norm"
    #: scales the mixer's input (Falcon-H1's ``ssm_in_multiplier``)
    in_multiplier: float = 1.0
    #: scales ``in_proj``'s output by part: ``z``, ``x``, ``B``, ``C``, ``dt`` (Falcon-H1's
    #: ``ssm_multipliers``); ``None``: unscaled
    proj_multipliers: tuple[float, float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.gate_norm not in ("gate_then_norm", "norm_then_gate", "gate"):
            raise ValueError(f"unknown mamba gate_norm {self.gate_norm!r}")
        if self.proj_multipliers is not None and len(self.proj_multipliers) != 5:
            raise ValueError(
                f"mamba projection multipliers must be 5 (z, x, B, C, dt), got "
                f"{self.proj_multipliers!r}"
            )
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"mamba heads ({self.num_heads}) x head_dim ({self.head_dim}) must equal the "
                f"mixer's intermediate size ({self.intermediate_size})"
            )
        if self.num_heads % self.n_groups or self.intermediate_size % self.n_groups:
            raise ValueError(
                f"mamba n_groups ({self.n_groups}) must divide the heads ({self.num_heads})"
            )
        if self.d_conv < 2:
            raise ValueError(f"mamba conv kernel must be >= 2, got {self.d_conv}")

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state


def check_silu(hf_config: Any, field: str = "hidden_act") -> None:
    """The mixer's activation is SiLU; anything else is a ``ValueError``."""
    act = getattr(hf_config, field, "silu")
    if act != "silu":
        raise ValueError(f"{field} {act!r} is not supported by the Mamba2 mixer (only 'silu')")


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))``, the statistics per group of ``group_size`` channels,
    in float32 (cast back before the weight, as HF's ``MambaRMSNormGated``). With
    ``norm_before_gate``: ``weight * rmsnorm(y) * silu(z)``, all in float32 and cast at the
    end (HF's ``FalconH1RMSNormGated``)."""

    def __init__(
        self,
        hidden_size: int,
        group_size: int,
        eps: float,
        norm_before_gate: bool = False,
        shared_group: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        #: under tensor parallelism, when this rank holds ``hidden_size`` channels of one
        #: group of ``group_size`` spread over several ranks: ``(that group's index, the
        #: number of groups)``; the squares are then summed over the tensor-parallel group
        self.shared_group = shared_group

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.float()
        if not self.norm_before_gate:
            y = y * F.silu(z.float())
        if self.shared_group is None:
            groups = y.view(*y.shape[:-1], -1, self.group_size)
            mean_square = groups.pow(2).mean(-1, keepdim=True)
        else:
            # this rank's channels are part of one group: every rank puts its sum of squares
            # in its group's column and the all-reduce adds up each group's (exact)
            group, num_groups = self.shared_group
            groups = y.view(*y.shape[:-1], 1, y.shape[-1])
            sums = y.new_zeros(*y.shape[:-1], num_groups)
            sums[..., group] = y.pow(2).sum(-1)
            sums = parallel_state.all_reduce(sums)
            mean_square = (sums[..., group] / self.group_size)[..., None, None]
        groups = groups * torch.rsqrt(mean_square + self.eps)
        if not self.norm_before_gate:
            return self.weight * groups.view(y.shape).to(dtype)
        return (self.weight.float() * groups.view(y.shape) * F.silu(z.float())).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer; its parameters are named as HF's (``in_proj``, ``conv1d``,
    ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).

    ``state_index`` is the position of this layer's first state tensor in the model's
    ``request_state_specs`` (its conv state; the SSM state follows).
    ``forward(hidden [T, hidden_size], ctx) -> [T, hidden_size]``.

    Under tensor parallelism (:mod:`chassis.core.parallel_state`) the layer keeps this
    rank's heads and groups (:mod:`chassis.core.layers.mamba2_shard`): ``spec`` is then the
    local share (``full_spec`` the checkpoint's), its state tensors are the local sizes, the
    checkpoint's tensors load through :meth:`checkpoint_part`, and :meth:`forward` returns
    ``out_proj``'s output summed over the group.
    """

    def __init__(self, spec: Mamba2Spec, state_index: int) -> None:
        super().__init__()
        self.shard = mamba2_shard(spec, parallel_state.tp_size(), parallel_state.tp_rank())
        #: the whole layer's shapes (the checkpoint's), and this rank's share of them
        self.full_spec = spec
        spec = self.spec = self.shard.local
        self.state_index = state_index
        #: run the scan token by token (the reference) instead of in chunks
        self.use_reference = False
        conv_dim = spec.conv_dim
        self.in_proj = nn.Linear(
            spec.hidden_size, spec.intermediate_size + conv_dim + spec.num_heads, spec.proj_bias
        )
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, spec.d_conv, groups=conv_dim, bias=spec.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm: GatedRMSNorm | None = None
        if spec.gate_norm != "gate":
            full = self.full_spec
            self.norm = GatedRMSNorm(
                spec.intermediate_size,
                full.intermediate_size // full.n_groups,
                spec.norm_eps,
                norm_before_gate=spec.gate_norm == "norm_then_gate",
                shared_group=(self.shard.first_group, full.n_groups)
                if self.shard.ranks_per_group > 1
                else None,
            )
        out_bias = spec.proj_bias if spec.out_proj_bias is None else spec.out_proj_bias
        self.out_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, out_bias)
        scale = None
        if spec.proj_multipliers is not None:
            widths = (spec.intermediate_size, spec.intermediate_size)
            widths += (spec.n_groups * spec.d_state,) * 2 + (spec.num_heads,)
            scale = torch.cat(
                [torch.full((n,), m) for n, m in zip(widths, spec.proj_multipliers, strict=True)]
            )
        #: ``in_proj``'s output scale (``spec.proj_multipliers`` per part), or ``None``
        self.proj_scale: torch.Tensor | None
        self.register_buffer("proj_scale", scale, persistent=False)

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """This rank's part of the checkpoint's whole tensor ``leaf`` of this layer
        (``in_proj.weight``, ``A_log``, ...; ``what``, the checkpoint name, for errors):
        :meth:`~chassis.core.layers.mamba2_shard.Mamba2Shard.checkpoint_part`; the tensor
        itself without tensor parallelism."""
        return self.shard.checkpoint_part(leaf, tensor, what or leaf)

    def state_specs(self, prefix: str, dtype: torch.dtype) -> list[RequestStateSpec]:
        """This layer's per-request tensors: the conv window and the SSM state, both stored
        in ``dtype`` (the model's, as HF and vLLM) unless --mamba-cache-dtype /
        --mamba-ssm-cache-dtype say otherwise; the scan runs in float32 either way."""
        s = self.spec
        return [
            RequestStateSpec(f"{prefix}.conv", (s.conv_dim, s.d_conv - 1), dtype, kind="conv"),
            RequestStateSpec(
                f"{prefix}.ssm", (s.num_heads, s.head_dim, s.d_state), dtype, kind="ssm"
            ),
        ]

    def graph_capture_blocker(self) -> str | None:
        return "Mamba2 layers read the step's request boundaries on the host (no graphs yet)"

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.spec
        dtype = hidden_states.dtype
        metadata = ctx.attn_metadata
        num_reqs = metadata.num_reqs
        bounds = metadata.query_start_loc_cpu.tolist()
        num_tokens = bounds[num_reqs]
        mixer_input = hidden_states[:num_tokens]
        if s.in_multiplier != 1.0:
            mixer_input = mixer_input * s.in_multiplier
        projected = self.in_proj(mixer_input)
        if self.proj_scale is not None:
            projected = (projected * self.proj_scale).to(projected.dtype)
        z, xbc, dt = projected.split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = s.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(lo, hi)
        A = -torch.exp(self.A_log.float())
        D = self.D.float()

        if ctx.request_states is None or ctx.state_slots is None:
            # memory profiling: every request starts from zeros and nothing is kept
            slots = None
            conv_states = xbc.new_zeros(num_reqs, s.conv_dim, s.d_conv - 1)
            ssm_states = xbc.new_zeros(
                num_reqs, s.num_heads, s.head_dim, s.d_state, dtype=torch.float32
            )
        else:
            slots = ctx.state_slots
            conv_pool = ctx.request_states[self.state_index]
            ssm_pool = ctx.request_states[self.state_index + 1]
            conv_states = conv_pool[slots]
            ssm_states = ssm_pool[slots].float()  # (a 16-bit pool: the scan stays float32)

        if num_tokens == num_reqs:  # one token per request: every request in one batch
            y, new_conv, new_ssm = self._decode(conv_states, ssm_states, xbc, dt, A, D)
        else:
            # requests with one token (decodes) in one batch, the others in another
            y = xbc.new_empty(num_tokens, s.num_heads, s.head_dim, dtype=torch.float32)
            new_conv = torch.empty_like(conv_states, dtype=xbc.dtype)
            new_ssm = torch.empty_like(ssm_states)
            split = step_split(tuple(bounds[: num_reqs + 1]), xbc.device)
            if len(split.single_rows):
                rows, tokens = split.single_rows, split.single_tokens
                y[tokens], new_conv[rows], new_ssm[rows] = self._decode(
                    conv_states[rows], ssm_states[rows], xbc[tokens], dt[tokens], A, D
                )
            if self.use_reference:
                for i in split.many:
                    a, b = bounds[i], bounds[i + 1]
                    y[a:b], new_conv[i], new_ssm[i] = self._prefill_reference(
                        conv_states[i], ssm_states[i], xbc[a:b], dt[a:b], A, D
                    )
            elif split.many:
                rows, tokens = split.many_rows, split.many_tokens
                y[tokens], new_conv[rows], new_ssm[rows] = self._prefill(
                    conv_states[rows],
                    ssm_states[rows],
                    xbc[tokens],
                    dt[tokens],
                    A,
                    D,
                    split.many_lengths,
                )
        if slots is not None:
            conv_pool.index_copy_(0, slots, new_conv.to(conv_pool.dtype))
            ssm_pool.index_copy_(0, slots, new_ssm.to(ssm_pool.dtype))
        y = y.reshape(num_tokens, s.intermediate_size)
        if self.norm is None:
            out = (y * F.silu(z.float())).to(dtype)
        else:
            out = self.norm(y, z, dtype)
        # (under tensor parallelism: each rank's heads' share, summed over the group)
        out = parallel_state.all_reduce(self.out_proj(out))
        if out.shape[0] < hidden_states.shape[0]:  # padding rows past the step's tokens
            out = torch.cat([out, out.new_zeros(hidden_states.shape[0] - num_tokens, out.shape[1])])
        return out

    def _decode(
        self,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of ``R`` requests: ``conv_states [R, conv_dim, d_conv - 1]``,
        ``ssm_states [R, H, P, N]``, ``xbc [R, conv_dim]``, ``dt [R, H]``; returns
        ``(y [R, H, P], new conv states, new SSM states)``."""
        window = torch.cat([conv_states.to(xbc.dtype), xbc[:, :, None]], dim=-1)
        conv_out = (window * self.conv1d.weight[:, 0, :]).sum(-1)
        if self.conv1d.bias is not None:
            conv_out = conv_out + self.conv1d.bias
        x, B, C = self._split_conv(F.silu(conv_out), xbc.shape[0])
        y, new_ssm = ssd_step(ssm_states, x, dt, A, B, C, D)
        return y, window[:, :, 1:], new_ssm

    def _prefill(
        self,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
        lengths: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Several requests' tokens at once: ``conv_states [R, conv_dim, d_conv - 1]``,
        ``ssm_states [R, H, P, N]``, ``xbc [T, conv_dim]`` and ``dt [T, H]`` with request
        ``r``'s ``lengths[r]`` tokens contiguous; returns ``(y [T, H, P], new conv states,
        new SSM states)``.

        The conv is :func:`~chassis.core.layers.causal_conv.packed_causal_conv` (one conv1d
        over every request's state and tokens); the scan is :func:`ssd_chunked_varlen`."""
        s = self.spec
        num_tokens = xbc.shape[0]
        conv_out, new_conv = packed_causal_conv(self.conv1d, conv_states, xbc, lengths)
        x, B, C = self._split_conv(F.silu(conv_out), num_tokens)
        y, new_ssm = ssd_chunked_varlen(ssm_states, x, dt, A, B, C, D, lengths, s.chunk_size)
        return y, new_conv, new_ssm

    def _prefill_reference(
        self,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference for one request's ``L`` tokens: ``conv_state [conv_dim, d_conv -
        1]``, ``ssm_state [H, P, N]``, ``xbc [L, conv_dim]``, ``dt [L, H]``; a padded conv1d
        and the token-by-token scan; returns ``(y [L, H, P], new conv state, new SSM
        state)``."""
        s = self.spec
        window = torch.cat([conv_state.to(xbc.dtype), xbc.T], dim=-1)
        conv_out = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=s.conv_dim)
        x, B, C = self._split_conv(F.silu(conv_out[0].T), xbc.shape[0])
        y, h = ssd_recurrence(ssm_state, x, dt, A, B, C, D)
        return y, window[:, -(s.d_conv - 1) :], h

    def _split_conv(
        self, conv_out: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, conv_dim]`` -> ``x [T, heads, head_dim]``, ``B``/``C`` ``[T, groups, d_state]``."""
        s = self.spec
        group_width = s.n_groups * s.d_state
        x, B, C = conv_out.split([s.intermediate_size, group_width, group_width], dim=-1)
        return (
            x.reshape(num_tokens, s.num_heads, s.head_dim),
            B.reshape(num_tokens, s.n_groups, s.d_state),
            C.reshape(num_tokens, s.n_groups, s.d_state),
        )


class ShardedMixer(Protocol):
    """A layer that cuts its own checkpoint tensors for this rank (the Mamba2 and Mamba-1
    mixers)."""

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """This rank's part of the layer's whole checkpoint tensor ``leaf``."""
        ...


def mamba2_mixers(model: nn.Module) -> dict[str, ShardedMixer]:
    """``model``'s mixers that cut their checkpoint tensors (a ``checkpoint_part``
    method: the Mamba2 and Mamba-1 mixers) by module name, for
    :func:`mamba2_checkpoint_part`."""
    return {
        name: module  # type: ignore[misc]
        for name, module in model.named_modules()
        if callable(getattr(module, "checkpoint_part", None))
    }


def mamba2_checkpoint_part(
    mixers: Mapping[str, ShardedMixer], name: str, tensor: torch.Tensor
) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` when it belongs to one of ``mixers``
    (named as in the model: ``backbone.layers.0.mixer.in_proj.weight``), else ``tensor``
    unchanged (also without tensor parallelism)."""
    if parallel_state.tp_size() == 1:
        return tensor
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mixer = mixers.get(".".join(parts[:i]))
        if mixer is not None:
            return mixer.checkpoint_part(".".join(parts[i:]), tensor, name)
    return tensor
