"""Per-request recurrent state: fixed-size tensors a model carries from step to step.

A state-space layer (Mamba2) keeps no per-token K/V; it keeps, per request, a few tensors of
a fixed shape (a convolution window and an SSM state) that each step reads and overwrites. A
model declares them (:meth:`~chassis.core.model_interface.CausalLM.request_state_specs`); the
model runner allocates one :class:`RequestStatePool` of ``max_num_seqs`` slots before the KV
cache is sized, gives each request in its persistent batch a slot, zeroed when the request
arrives (also when it comes back after a preemption, which recomputes it from position 0),
freed when it finishes or is preempted, and passes each scheduled request's slot to the model
through :class:`~chassis.core.attention.ForwardContext` (``state_slots``,
``request_states``). The states are stored in the dtypes the model declares (its own) unless
``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` say otherwise
(:func:`resolve_state_specs`); a pool that does not fit is a start-up error naming its size;
sleep mode frees it with the KV cache and wakes it up zeroed.

A state summarizes the whole prefix, so a prefix-cache hit (which skips computing the prefix)
cannot restore it, and speculative decoding would have to roll a state back over rejected
drafts: :func:`apply_recurrent_state_settings` turns the first off and refuses the second for
such models.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chassis.core.config import MAMBA_CACHE_DTYPES

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)


#: the values of ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` (vLLM's, listed in
#: ``EngineConfig``'s module) -> the state's dtype; ``auto`` (``None``) keeps the dtype the
#: model declares (its own dtype)
STATE_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    name: None if name == "auto" else getattr(torch, name) for name in MAMBA_CACHE_DTYPES
}
#: what a :class:`RequestStateSpec` may be (``kind``), for the dtype flags
STATE_KINDS = ("conv", "ssm")


@dataclass(frozen=True)
class RequestStateSpec:
    """One tensor every request carries: ``shape`` (per request) in ``dtype``; ``name`` says
    whose it is (``"layers.3.conv"``), for messages.

    ``kind`` says which flag may change the dtype (:func:`resolve_state_specs`):
    ``"conv"`` (a convolution window) follows ``--mamba-cache-dtype``, ``"ssm"`` (a
    state-space or linear-attention state) ``--mamba-ssm-cache-dtype`` and then
    ``--mamba-cache-dtype``; ``None`` (the default) keeps ``dtype`` whatever the flags say.
    ``dtype`` is what ``auto`` keeps: the model's dtype, as vLLM and HF transformers do.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in STATE_KINDS:
            raise ValueError(
                f"request state {self.name!r}: kind must be one of {', '.join(STATE_KINDS)} "
                f"or None; got {self.kind!r}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of one request's tensor."""
        return math.prod(self.shape) * torch.tensor([], dtype=self.dtype).element_size()


def resolve_state_specs(
    specs: Sequence[RequestStateSpec],
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
) -> list[RequestStateSpec]:
    """``specs`` with the dtypes the flags choose (vLLM's semantics): a ``"conv"`` spec takes
    ``mamba_cache_dtype``; an ``"ssm"`` spec ``mamba_ssm_cache_dtype``, or when that is
    ``auto`` ``mamba_cache_dtype``; ``auto`` (and a spec without a kind) keeps the spec's
    dtype. Unknown values are a ``ValueError``."""
    for flag, value in (
        ("--mamba-cache-dtype", mamba_cache_dtype),
        ("--mamba-ssm-cache-dtype", mamba_ssm_cache_dtype),
    ):
        if value not in STATE_CACHE_DTYPES:
            raise ValueError(
                f"{flag} must be one of {', '.join(STATE_CACHE_DTYPES)}; got {value!r}"
            )
    ssm_choice = mamba_cache_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
    chosen = {"conv": STATE_CACHE_DTYPES[mamba_cache_dtype], "ssm": STATE_CACHE_DTYPES[ssm_choice]}
    resolved = []
    for spec in specs:
        dtype = chosen.get(spec.kind) if spec.kind is not None else None
        resolved.append(spec if dtype is None else replace(spec, dtype=dtype))
    return resolved


def describe_state_pool(specs: Sequence[RequestStateSpec], num_slots: int) -> str:
    """The pool's size for messages: ``"2 slots x 1.5 MiB = 3.0 MiB (conv float32, ssm
    bfloat16)"``."""
    per_slot = sum(spec.nbytes for spec in specs)
    dtypes: dict[str, str] = {}
    for spec in specs:
        dtypes.setdefault(spec.kind or "other", str(spec.dtype).removeprefix("torch."))
    kinds = ", ".join(f"{kind} {dtype}" for kind, dtype in dtypes.items())
    slots = f"{num_slots} slot{'' if num_slots == 1 else 's'}"
    return f"{slots} x {format_bytes(per_slot)} = {format_bytes(per_slot * num_slots)} ({kinds})"


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in MiB (one decimal), or KiB below 1 MiB, or GiB from 1 GiB on."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


#: makes a zeroed tensor of ``shape`` and ``dtype`` on ``device``
ZerosFn = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _torch_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


#: what to change when the pool is too large, for messages
POOL_SETTINGS_HINT = (
    "lower --max-num-seqs (one slot per sequence), or mind --mamba-cache-dtype / "
    "--mamba-ssm-cache-dtype (float32 states take twice the memory of 16-bit ones)"
)


def pool_settings_hint(specs: Sequence[RequestStateSpec]) -> str:
    """:data:`POOL_SETTINGS_HINT`, without the dtype flags when no spec has a kind they
    change (Whisper's cross K/V: only --max-num-seqs sizes its pool)."""
    if any(spec.kind is not None for spec in specs):
        return POOL_SETTINGS_HINT
    return "lower --max-num-seqs (one slot per sequence)"


def state_pool_over_budget(pool: RequestStatePool, left: int, *, profiled: bool) -> str:
    """The message when the memory left for the KV cache after ``pool`` is ``left`` < 0
    bytes: a fixed budget (``--kv-cache-memory``, the CPU's default) smaller than the pool,
    or, ``profiled``, device memory under ``--gpu-memory-utilization`` used up with it."""
    if profiled:
        where = (
            "does not fit beside the model and its activations in --gpu-memory-utilization's "
            f"share of the device memory ({format_bytes(-left)} short)"
        )
    else:
        where = (
            f"does not fit in the KV cache budget of {format_bytes(left + pool.nbytes)} "
            "(--kv-cache-memory; the CPU's default: 4 GiB or 30% of free memory)"
        )
    return (
        f"the per-request recurrent state pool ({pool.describe()}) {where}: "
        f"{pool_settings_hint(pool.specs)}"
        f"{'' if profiled else ', or raise --kv-cache-memory'}"
    )


class RequestStatePool:
    """``num_slots`` slots of every spec's tensor: ``tensors[k]`` is ``[num_slots, *shape]``.

    ``allocate(request_id)`` hands out a free slot, zeroed; ``free(request_id)`` returns it.
    Slots are independent of persistent-batch rows (which move when requests leave).
    The specs' dtypes are used as given (:func:`resolve_state_specs` applies the flags).
    A pool the device cannot hold is a ``ValueError`` naming its size and the settings that
    shrink it, not a bare out-of-memory error. Sleep mode drops the tensors
    (:meth:`release`) and allocates them again, zeroed (:meth:`restore`).
    """

    def __init__(
        self,
        specs: Sequence[RequestStateSpec],
        num_slots: int,
        device: torch.device | str,
        zeros: ZerosFn | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a request state pool needs at least one slot, got {num_slots}")
        self.specs = tuple(specs)
        self.num_slots = num_slots
        self.device = torch.device(device)
        #: makes a zeroed tensor (``Platform.kv_cache_zeros``: on the CPU, pages that are
        #: only committed when a slot is used, so a pool over the budget is refused before
        #: it takes any memory); ``torch.zeros`` by default
        self._zeros: ZerosFn = zeros or _torch_zeros
        #: one tensor per spec, ``[num_slots, *spec.shape]``, in the spec's order (empty
        #: while released)
        self.tensors: list[torch.Tensor] = []
        self.restore()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_of: dict[str, int] = {}

    def describe(self) -> str:
        """Slots, bytes and dtypes, for logs and messages."""
        return describe_state_pool(self.specs, self.num_slots)

    @property
    def released(self) -> bool:
        """Whether the tensors are dropped (sleep mode)."""
        return not self.tensors

    def release(self) -> None:
        """Drop the tensors (sleep mode: no request runs until :meth:`restore`); their memory
        is freed once the platform's allocator lets go of it. The slots stay assigned: the
        requests still holding one are finished ones the runner has not yet heard of."""
        self.tensors = []

    def restore(self) -> None:
        """Allocate the tensors, zeroed, when released (start-up, sleep mode's wake-up);
        nothing otherwise. Out of memory: a ``ValueError`` with the pool's size."""
        if not self.released:
            return
        try:
            self.tensors = [
                self._zeros((self.num_slots, *spec.shape), spec.dtype, self.device)
                for spec in self.specs
            ]
        except RuntimeError as error:  # (torch.OutOfMemoryError; the CPU allocator's own)
            self.tensors = []
            raise ValueError(
                f"the per-request recurrent state pool ({self.describe()}) does not fit in "
                f"the device's memory: {pool_settings_hint(self.specs)}"
            ) from error

    @property
    def bytes_per_slot(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.bytes_per_slot * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        """A zeroed slot for ``request_id`` (a ``RuntimeError`` when none is free or it
        already holds one)."""
        if request_id in self.slot_of:
            raise RuntimeError(f"request {request_id!r} already holds state slot")
        if not self._free:
            raise RuntimeError(
                f"no free request-state slot for {request_id!r}: all {self.num_slots} are held "
                "(more requests in the batch than --max-num-seqs?)"
            )
        slot = self._free.pop()
        for tensor in self.tensors:
            tensor[slot].zero_()
        self.slot_of[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Return ``request_id``'s slot, if it holds one."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, request_ids: Iterable[str]) -> np.ndarray:
        """The slots of ``request_ids`` in order (int64)."""
        return np.array([self.slot_of[r] for r in request_ids], dtype=np.int64)


def apply_recurrent_state_settings(config: EngineConfig, model_cls: Any) -> None:
    """For a model with recurrent state (``model_cls.has_recurrent_state``): turn prefix
    caching off (one info line) and refuse speculative decoding (``ValueError``). Nothing for
    other models."""
    if not getattr(model_cls, "has_recurrent_state", False):
        return
    name = model_cls.__name__
    label = getattr(model_cls, "recurrent_state_label", "state-space layers")
    if config.speculative_config is not None:
        raise ValueError(
            f"{name} carries a recurrent state per request ({label}), which "
            "speculative decoding would have to roll back over rejected drafts: "
            "--speculative-config is not supported with it"
        )
    if config.enable_prefix_caching:
        logger.info(
            "%s carries a recurrent state per request (%s), which a prefix-"
            "cache hit cannot restore: prefix caching is off",
            name,
            label,
        )
    config.enable_prefix_caching = False
