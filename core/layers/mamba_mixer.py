"""The Mamba-1 mixer (Mamba, Falcon Mamba, Jamba's mamba layers): a selective state-space
layer in place of attention.

Per token: ``in_proj`` gives ``x`` and the gate ``z`` (``intermediate`` channels each); a
depthwise causal conv1d (window ``d_conv``) with SiLU over ``x``; ``x_proj`` gives the
step-size features (``dt_rank``), ``B`` and ``C`` (``d_state`` each), optionally RMS-
normalized (:attr:`MambaSpec.bcdt_norm`); ``dt = softplus(dt_proj(dt))``; the selective scan
(:mod:`chassis.core.layers.selective_scan`) with ``A = -exp(A_log)`` and the ``D`` skip; the
gate ``y * silu(z)`` and ``out_proj``.

Each request carries two tensors across steps (:meth:`MambaMixer.state_specs`): the last
``d_conv - 1`` conv inputs ``[intermediate, d_conv - 1]`` and the SSM state ``[intermediate,
d_state]``, stored in the model dtype unless ``--mamba-cache-dtype`` /
``--mamba-ssm-cache-dtype`` say otherwise (the scan computes in float32: a 16-bit state is
widened when read and rounded when written), read from the request's slot
(``ctx.state_slots``) and written back, as the Mamba2 mixer does
(:mod:`chassis.core.layers.mamba2_mixer`, whose step split this reuses; the prefill conv is
:mod:`chassis.core.layers.causal_conv`'s).
Decodes advance in one batched step; prefill chunks run one varlen scan (a token loop or a
parallel scan, :attr:`MambaMixer.use_reference`).

Under tensor parallelism (as vLLM's ``MambaMixer``) each rank keeps ``intermediate / N``
channels: its rows of ``in_proj``'s ``x`` and ``z`` halves, of ``conv1d``, ``dt_proj``,
``A_log`` and ``D``, and its columns of ``x_proj`` and ``out_proj``; ``x_proj``'s partial
outputs (``dt``, ``B``, ``C``, which every channel reads) and ``out_proj``'s are summed over
the group. A model loads the checkpoint's whole tensors through
:meth:`MambaMixer.checkpoint_part`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.causal_conv import packed_causal_conv
from chassis.core.layers.selective_scan import selective_scan_varlen, selective_step
from chassis.core.layers.step_split import step_split
from chassis.core.request_state_cache import RequestStateSpec

#: how ``dt``, ``B`` and ``C`` are normalized after ``x_proj``: not at all (Mamba), an RMS
#: norm without weight (Falcon Mamba, ``mixer_rms_eps``), an RMS norm with a weight each
#: (Jamba: ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``)
BcdtNorm = Literal["none", "weightless", "weighted"]


@dataclass(frozen=True)
class MambaSpec:
    """The mixer's shapes and options (read from each architecture's config fields)."""

    hidden_size: int
    intermediate_size: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    bcdt_norm: BcdtNorm = "none"
    bcdt_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.d_conv < 2:
            raise ValueError(f"mamba conv kernel must be >= 2, got {self.d_conv}")
        if min(self.intermediate_size, self.d_state, self.dt_rank) < 1:
            raise ValueError(
                "mamba intermediate size, state size and dt rank must be positive, got "
                f"{self.intermediate_size}, {self.d_state}, {self.dt_rank}"
            )


class _RMSNormNoWeight(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in float32, cast back (Falcon Mamba's B/C/dt norms)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _RMSNorm(_RMSNormNoWeight):
    """The weighted RMS norm (Jamba's ``*_layernorm``): ``weight * norm(x)``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(eps)
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * super().forward(x)


class MambaMixer(nn.Module):
    """One Mamba-1 layer; its parameters are named as HF's (``in_proj``, ``conv1d``,
    ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``, and with ``"weighted"``
    norms ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``).

    ``state_index`` is the position of this layer's conv state in the model's
    ``request_state_specs`` (the SSM state follows).
    ``forward(hidden [T, hidden_size], ctx) -> [T, hidden_size]``.
    """

    def __init__(self, spec: MambaSpec, state_index: int) -> None:
        super().__init__()
        #: the whole layer's shapes (the checkpoint's); ``spec`` is this rank's share
        self.full_spec = spec
        #: this rank's first channel of the ``intermediate`` ones (0 without tensor parallelism)
        self.first_channel, inner = parallel_state.shard(
            spec.intermediate_size, "the Mamba mixer's intermediate_size"
        )
        spec = self.spec = dataclasses.replace(spec, intermediate_size=inner)
        self.state_index = state_index
        #: prefill scans token by token (``True``, the default) or as parallel scans
        #: (``False``; see :func:`~chassis.core.layers.selective_scan.selective_scan_varlen`)
        self.use_reference = True
        inner = spec.intermediate_size
        self.in_proj = nn.Linear(spec.hidden_size, 2 * inner, spec.proj_bias)
        self.conv1d = nn.Conv1d(inner, inner, spec.d_conv, groups=inner, bias=spec.conv_bias)
        self.x_proj = nn.Linear(inner, spec.dt_rank + 2 * spec.d_state, bias=False)
        self.dt_proj = nn.Linear(spec.dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(inner, spec.d_state))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, spec.hidden_size, spec.proj_bias)
        self.dt_layernorm: nn.Module | None = None
        self.b_layernorm: nn.Module | None = None
        self.c_layernorm: nn.Module | None = None
        if spec.bcdt_norm == "weighted":
            self.dt_layernorm = _RMSNorm(spec.dt_rank, spec.bcdt_norm_eps)
            self.b_layernorm = _RMSNorm(spec.d_state, spec.bcdt_norm_eps)
            self.c_layernorm = _RMSNorm(spec.d_state, spec.bcdt_norm_eps)
        elif spec.bcdt_norm == "weightless":
            self.dt_layernorm = _RMSNormNoWeight(spec.bcdt_norm_eps)
            self.b_layernorm = _RMSNormNoWeight(spec.bcdt_norm_eps)
            self.c_layernorm = _RMSNormNoWeight(spec.bcdt_norm_eps)

    def checkpoint_part(self, leaf: str, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """This rank's part of the checkpoint's whole tensor ``leaf`` of this layer
        (``in_proj.weight``, ``A_log``, ...; ``what``, the checkpoint name, for errors): its
        channels' rows (of both ``in_proj`` halves), ``x_proj``'s and ``out_proj``'s columns
        (``out_proj``'s bias on rank 0 alone); the tensor itself without tensor parallelism."""
        if parallel_state.tp_size() == 1:
            return tensor
        full, first, inner = (
            self.full_spec.intermediate_size,
            self.first_channel,
            self.spec.intermediate_size,
        )
        module = leaf.split(".")[0]
        if module == "in_proj":
            if tensor.shape[0] != 2 * full:
                raise ValueError(
                    f"checkpoint tensor {what or leaf!r} has {tensor.shape[0]} rows, expected "
                    f"{2 * full} (does config.json match the weights?)"
                )
            return torch.cat(
                [tensor[first : first + inner], tensor[full + first : full + first + inner]]
            )
        if module in ("conv1d", "dt_proj", "A_log", "D"):  # by channel (dt_proj: its rows)
            return tensor[first : first + inner]
        if leaf == "x_proj.weight" or leaf == "out_proj.weight":
            return tensor[:, first : first + inner]
        if leaf == "out_proj.bias":  # added once, after the sum over the ranks
            return tensor if parallel_state.tp_rank() == 0 else torch.zeros_like(tensor)
        return tensor

    def state_specs(self, prefix: str, dtype: torch.dtype) -> list[RequestStateSpec]:
        """This layer's per-request tensors: the conv window (``kind="conv"``) and the SSM
        state (``kind="ssm"``), in ``dtype`` (the model's, as HF and vLLM) unless
        --mamba-cache-dtype / --mamba-ssm-cache-dtype say otherwise; the scan runs in float32
        either way."""
        s = self.spec
        return [
            RequestStateSpec(
                f"{prefix}.conv", (s.intermediate_size, s.d_conv - 1), dtype, kind="conv"
            ),
            RequestStateSpec(f"{prefix}.ssm", (s.intermediate_size, s.d_state), dtype, kind="ssm"),
        ]

    def graph_capture_blocker(self) -> str | None:
        return "Mamba layers read the step's request boundaries on the host (no graphs yet)"

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.spec
        dtype = hidden_states.dtype
        metadata = ctx.attn_metadata
        num_reqs = metadata.num_reqs
        bounds = metadata.query_start_loc_cpu.tolist()
        num_tokens = bounds[num_reqs]
        x, z = self.in_proj(hidden_states[:num_tokens]).chunk(2, dim=-1)

        if ctx.request_states is None or ctx.state_slots is None:
            # memory profiling: every request starts from zeros and nothing is kept
            slots = None
            conv_states = x.new_zeros(num_reqs, s.intermediate_size, s.d_conv - 1)
            ssm_states = x.new_zeros(num_reqs, s.intermediate_size, s.d_state, dtype=torch.float32)
        else:
            slots = ctx.state_slots
            conv_pool = ctx.request_states[self.state_index]
            ssm_pool = ctx.request_states[self.state_index + 1]
            conv_states = conv_pool[slots]
            ssm_states = ssm_pool[slots].float()  # (a 16-bit pool: the scan stays float32)

        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        if num_tokens == num_reqs:  # one token per request: every request in one batch
            xc, new_conv = self._conv_step(conv_states, x)
            dt, B, C = self._ssm_inputs(xc)
            y, new_ssm = selective_step(ssm_states, xc, dt, A, B, C, D)
        else:
            # requests with one token (decodes) in one batch, the others in another
            split = step_split(tuple(bounds[: num_reqs + 1]), x.device)
            xc = torch.empty_like(x)
            new_conv = torch.empty_like(conv_states, dtype=x.dtype)
            if len(split.single_rows):
                rows, tokens = split.single_rows, split.single_tokens
                xc[tokens], new_conv[rows] = self._conv_step(conv_states[rows], x[tokens])
            if split.many:
                rows, tokens = split.many_rows, split.many_tokens
                xc[tokens], new_conv[rows] = self._conv_packed(
                    conv_states[rows], x[tokens], split.many_lengths
                )
            dt, B, C = self._ssm_inputs(xc)
            y = xc.new_empty(num_tokens, s.intermediate_size, dtype=torch.float32)
            new_ssm = torch.empty_like(ssm_states)
            if len(split.single_rows):
                rows, tokens = split.single_rows, split.single_tokens
                y[tokens], new_ssm[rows] = selective_step(
                    ssm_states[rows], xc[tokens], dt[tokens], A, B[tokens], C[tokens], D
                )
            if split.many:
                rows, tokens = split.many_rows, split.many_tokens
                y[tokens], new_ssm[rows] = selective_scan_varlen(
                    ssm_states[rows],
                    xc[tokens],
                    dt[tokens],
                    A,
                    B[tokens],
                    C[tokens],
                    D,
                    split.many_lengths,
                    reference=self.use_reference,
                )
        if slots is not None:
            conv_pool.index_copy_(0, slots, new_conv.to(conv_pool.dtype))
            ssm_pool.index_copy_(0, slots, new_ssm.to(ssm_pool.dtype))
        # (under tensor parallelism: each rank's channels' share, summed over the group)
        out = parallel_state.all_reduce(self.out_proj((y * F.silu(z.float())).to(dtype)))
        if out.shape[0] < hidden_states.shape[0]:  # padding rows past the step's tokens
            out = torch.cat([out, out.new_zeros(hidden_states.shape[0] - num_tokens, out.shape[1])])
        return out

    def _ssm_inputs(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``xc [T, I]`` (after the conv) -> ``dt [T, I]`` (float32, after softplus),
        ``B``/``C`` ``[T, N]``."""
        s = self.spec
        # every channel reads dt, B and C: the ranks' partial products are summed
        projected = parallel_state.all_reduce(self.x_proj(xc))
        dt, B, C = projected.split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if self.dt_layernorm is not None:
            assert self.b_layernorm is not None and self.c_layernorm is not None
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # HF adds dt_proj's bias in float32 inside the scan, after the matmul
        dt = F.softplus(dt @ self.dt_proj.weight.T + self.dt_proj.bias.float())
        return dt.float(), B, C

    def _conv_step(
        self, conv_states: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token each: ``conv_states [R, I, d_conv - 1]``, ``x [R, I]``; returns
        ``(silu(conv) [R, I], new conv states)``."""
        window = torch.cat([conv_states.to(x.dtype), x[:, :, None]], dim=-1)
        out = (window * self.conv1d.weight[:, 0, :]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        return F.silu(out), window[:, :, 1:]

    def _conv_packed(
        self, conv_states: torch.Tensor, x: torch.Tensor, lengths: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several requests' tokens (request ``r``'s ``lengths[r]`` contiguous in ``x [T,
        I]``) after their conv states ``[R, I, d_conv - 1]``; returns ``(silu(conv) [T, I],
        new conv states)``: :func:`~chassis.core.layers.causal_conv.packed_causal_conv`."""
        out, new_states = packed_causal_conv(self.conv1d, conv_states, x, lengths)
        return F.silu(out), new_states
