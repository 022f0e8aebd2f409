"""Per-request recurrent state: fixed-size tensors a model carries from step to step.

A state-space layer (Mamba2) keeps no per-token K/V; it keeps, per request, a few tensors of
a fixed shape (a convolution window and an SSM state) that each step reads and overwrites. A
model declares them (:meth:`~chassis.core.model_interface.CausalLM.request_state_specs`); the
model runner allocates one :class:`RequestStatePool` of ``max_num_seqs`` slots before the KV
cache is sized, gives each request in its persistent batch a slot, zeroed when the request
arrives (also when it comes back after a preemption, which recomputes it from position 0),
freed when it finishes or is preempted, and passes each scheduled request's slot to the model
through :class:`~chassis.core.attention.ForwardContext` (``state_slots``,
``request_states``).

A state summarizes the whole prefix, so a prefix-cache hit (which skips computing the prefix)
cannot restore it, and speculative decoding would have to roll a state back over rejected
drafts: :func:`apply_recurrent_state_settings` turns the first off and refuses the second for
such models.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestStateSpec:
    """One tensor every request carries: ``shape`` (per request) in ``dtype``; ``name`` says
    whose it is (``"layers.3.conv"``), for messages."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one request's tensor."""
        return math.prod(self.shape) * torch.tensor([], dtype=self.dtype).element_size()


class RequestStatePool:
    """``num_slots`` slots of every spec's tensor: ``tensors[k]`` is ``[num_slots, *shape]``.

    ``allocate(request_id)`` hands out a free slot, zeroed; ``free(request_id)`` returns it.
    Slots are independent of persistent-batch rows (which move when requests leave).
    """

    def __init__(
        self, specs: Sequence[RequestStateSpec], num_slots: int, device: torch.device | str
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a request state pool needs at least one slot, got {num_slots}")
        self.specs = tuple(specs)
        self.num_slots = num_slots
        #: one tensor per spec, ``[num_slots, *spec.shape]``, in the spec's order
        self.tensors = [
            torch.zeros((num_slots, *spec.shape), dtype=spec.dtype, device=device)
            for spec in self.specs
        ]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_of: dict[str, int] = {}

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
    if config.speculative_config is not None:
        raise ValueError(
            f"{name} carries a recurrent state per request (state-space layers), which "
            "speculative decoding would have to roll back over rejected drafts: "
            "--speculative-config is not supported with it"
        )
    if config.enable_prefix_caching:
        logger.info(
            "%s carries a recurrent state per request (state-space layers), which a prefix-"
            "cache hit cannot restore: prefix caching is off",
            name,
        )
    config.enable_prefix_caching = False
