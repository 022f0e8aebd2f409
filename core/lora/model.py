"""``LoRAModel``: a model's adaptable layers wrapped, and the batch's adapters in device slots.

Built by the worker when ``--enable-lora`` is on, after the weights are loaded and before
the platform prepares the model (a platform that swaps ``nn.Linear`` layers for its own
kernels then swaps the wrapped base layers). Each step the runner calls
:meth:`LoRAModel.prepare_step` with the adapter of every token; adapters not in a slot are
loaded into one (a free slot, else the least recently used one that the step does not
need) from host memory.

Host memory holds every *pinned* adapter (:meth:`LoRAModel.pin`: the engine core pins the
adapter of each request it accepts, before the request can be scheduled, and unpins it when
the request's last one finishes) and the last ``max_cpu_loras`` unpinned ones. Reading a
folder is where an adapter can fail (deleted, unreadable, corrupted since the front-end
checked it): :meth:`~LoRAModel.pin` raises ``ValueError`` then, and the engine core refuses
that request alone. A step reads a folder only for an adapter nobody pinned (a runner
driven without the engine core).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.lora.adapter import AdapterWeights, load_adapter
from chassis.core.lora.layers import LoRALinear, LoRAStepState, layer_device

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)


class LoRAModel:
    """Wraps every linear layer of ``model`` that :meth:`CausalLM.lora_slices` names.

    :param max_loras: device slots: the most distinct adapters one step can run
    :param max_rank: the largest adapter rank (smaller ones are zero-padded)
    :param max_cpu_loras: adapters kept read in host memory (at least ``max_loras``)
    :param max_num_tokens: the most tokens one forward runs (``--max-num-batched-tokens``)
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_num_tokens: int,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        weight = next(p for p in model.parameters() if p.device.type != "meta")
        self.state = LoRAStepState(
            torch.zeros(max_num_tokens, max_loras, dtype=torch.float32, device=weight.device)
        )
        #: HF module name -> (wrapper, slice index)
        self._targets: dict[str, tuple[LoRALinear, int]] = {}
        #: HF module name -> (in_features, out_features), whole (not this rank's share): what
        #: adapters are checked against (the names' aliases too)
        self.target_shapes: dict[str, tuple[int, int]] = {}
        #: HF module name -> the other names an adapter may give it
        #: (:meth:`CausalLM.lora_module_aliases`)
        self._aliases: dict[str, tuple[str, ...]] = {}
        self._shard = model.lora_shard
        self._wrap(model)
        if not self._targets:
            raise ValueError(
                f"{type(model).__name__} has no linear layer a LoRA adapter can change; "
                "drop --enable-lora"
            )
        #: the adapter id each slot holds (None: free), and when each slot was last used
        self._slot_ids: list[int | None] = [None] * max_loras
        self._slot_used = [0] * max_loras
        self._step = 0
        #: whether the adapter matmuls run in every forward (:meth:`keep_active`)
        self._always_active = False
        #: whether a step may have left one-hot rows in the mask
        self._mask_dirty = False
        self._requests: dict[int, LoRARequest] = {}
        #: unpinned adapters read from disk, least recently used first (``max_cpu_loras``)
        self._read: OrderedDict[int, AdapterWeights] = OrderedDict()
        #: pinned adapters (kept in host memory whatever their number) and their pin counts
        self._pinned: dict[int, tuple[AdapterWeights, int]] = {}

    def _wrap(self, model: CausalLM) -> None:
        found = []
        for parent_name, parent in model.named_modules():
            for child_name, child in parent.named_children():
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                slices = model.lora_slices(name, child)
                if slices and layer_device(child).type != "meta":
                    found.append((parent, child_name, child, slices))
        for parent, child_name, child, slices in found:
            wrapper = LoRALinear(
                child, [(s.first_row, s.rows) for s in slices], self.state,
                self.max_loras, self.max_rank,
            )  # fmt: skip
            setattr(parent, child_name, wrapper)
            for index, piece in enumerate(slices):
                self._targets[piece.hf_module] = (wrapper, index)
                # (a model that is not a CausalLM, as some tests' stand-ins, has none)
                alias_hook = getattr(model, "lora_module_aliases", None)
                aliases = alias_hook(piece.hf_module) if alias_hook is not None else ()
                self._aliases[piece.hf_module] = aliases
                for name in (piece.hf_module, *aliases):
                    self.target_shapes[name] = (piece.in_features, piece.out_features)

    # -- adapters ---------------------------------------------------------------------------

    def add_request(self, lora_request: LoRARequest) -> None:
        """Remember where adapter ``lora_int_id`` is read from (a request that runs it
        arrived); the front-end has checked it (:func:`~chassis.core.lora.adapter.check_adapter`)."""
        self._requests[lora_request.lora_int_id] = lora_request

    def pin(self, lora_request: LoRARequest) -> None:
        """Hold adapter ``lora_int_id`` in host memory until as many :meth:`unpin` calls, so
        that no step needs to read its folder; read the folder now unless it is held already.

        A ``ValueError`` with the reason when the folder cannot be read or no longer holds
        an adapter that fits the model; nothing changes then (a later pin reads it again).
        """
        lora_id = lora_request.lora_int_id
        held = self._pinned.get(lora_id)
        if held is not None and self._requests.get(lora_id) == lora_request:
            self._pinned[lora_id] = (held[0], held[1] + 1)
            return
        if held is not None:
            raise ValueError(
                f"LoRA adapter id {lora_id} is pinned for {self._requests[lora_id].lora_path}; "
                f"{lora_request.lora_path} cannot take it (give each adapter its own id)"
            )
        weights = self._read.pop(lora_id, None)
        if weights is None or self._requests.get(lora_id) != lora_request:
            weights = self._load(lora_request)
        self._requests[lora_id] = lora_request
        self._pinned[lora_id] = (weights, 1)

    def unpin(self, lora_id: int) -> None:
        """Undo one :meth:`pin`; after the last, the adapter joins the ``max_cpu_loras`` most
        recently used unpinned ones (an unknown id is ignored)."""
        held = self._pinned.pop(lora_id, None)
        if held is None:
            return
        weights, count = held
        if count > 1:
            self._pinned[lora_id] = (weights, count - 1)
            return
        self._read[lora_id] = weights
        while len(self._read) > self.max_cpu_loras:
            self._read.popitem(last=False)

    @property
    def pinned_ids(self) -> list[int]:
        """The adapters held by :meth:`pin`, in no particular order."""
        return list(self._pinned)

    def _load(self, request: LoRARequest) -> AdapterWeights:
        """Read ``request``'s folder (``ValueError`` when it cannot be applied)."""
        weights = load_adapter(request.lora_path, self.target_shapes, self.max_rank)
        logger.info(
            "LoRA adapter %r (id %d) read from %s: %d modules, rank %d",
            request.lora_name,
            request.lora_int_id,
            request.lora_path,
            len(weights.modules),
            weights.max_rank,
        )
        return weights

    def _weights(self, lora_id: int) -> AdapterWeights:
        held = self._pinned.get(lora_id)
        if held is not None:
            return held[0]
        weights = self._read.get(lora_id)
        if weights is not None:
            self._read.move_to_end(lora_id)
            return weights
        # Not pinned: a runner driven without the engine core; a failure here fails the step.
        weights = self._load(self._requests[lora_id])
        self._read[lora_id] = weights
        while len(self._read) > self.max_cpu_loras:
            self._read.popitem(last=False)
        return weights

    def _slot_for(self, lora_id: int, needed: set[int]) -> int:
        """The slot holding ``lora_id``, loading it into a free or least recently used slot
        that no adapter in ``needed`` (this step's) holds."""
        if lora_id in self._slot_ids:
            return self._slot_ids.index(lora_id)
        candidates = [s for s, held in enumerate(self._slot_ids) if held not in needed]
        slot = min(candidates, key=lambda s: (self._slot_ids[s] is not None, self._slot_used[s]))
        weights = self._weights(lora_id)
        for hf_name, (wrapper, index) in self._targets.items():
            pair = next(
                (
                    weights.modules[name]
                    for name in (hf_name, *self._aliases[hf_name])
                    if name in weights.modules
                ),
                None,
            )
            if pair is None:
                wrapper.set_slot(slot, index, None, None)
            else:  # this rank's part (all of it without tensor parallelism)
                wrapper.set_slot(slot, index, *self._shard(hf_name, *pair))
        self._slot_ids[slot] = lora_id
        return slot

    # -- steps ------------------------------------------------------------------------------

    def prepare_step(self, token_lora_ids: np.ndarray) -> None:
        """Set the step state for a forward whose token ``t`` runs adapter
        ``token_lora_ids[t]`` (0: none). A ``RuntimeError`` when more than ``max_loras``
        distinct adapters are asked for (the scheduler keeps a step within the limit)."""
        self._step += 1
        num_tokens = len(token_lora_ids)
        self._check_rows(num_tokens)
        used = np.unique(token_lora_ids)
        used = used[used > 0]
        if not len(used):
            if self._mask_dirty:
                # all rows zero for a captured graph or a compiled forward, which run the
                # adapter matmuls anyway (this step's rows, and those a later, longer step reads)
                self.state.token_mask.zero_()
                self._mask_dirty = False
            self.state.active = self._always_active
            return
        if len(used) > self.max_loras:
            raise RuntimeError(
                f"a step runs {len(used)} LoRA adapters, more than --max-loras "
                f"{self.max_loras}; the scheduler must keep a step within the limit"
            )
        needed = {int(i) for i in used}
        slot_of = np.full(int(used.max()) + 1, -1, dtype=np.int64)
        for lora_id in needed:
            slot = self._slot_for(lora_id, needed)
            slot_of[lora_id] = slot
            self._slot_used[slot] = self._step
        mask = np.zeros((num_tokens, self.max_loras), dtype=np.float32)
        slots = slot_of[token_lora_ids]
        adapted = np.nonzero(slots >= 0)[0]
        mask[adapted, slots[adapted]] = 1.0
        self.state.token_mask[:num_tokens].copy_(torch.from_numpy(mask), non_blocking=True)
        self.state.active = True
        self._mask_dirty = True

    def prepare_profile(self, num_tokens: int) -> None:
        """A step state that runs the adapter matmuls with no adapter applied (all-zero
        mask): for a profiling forward, which then sees their memory, and for capturing
        decode graphs, which then run them at every replay."""
        self._check_rows(num_tokens)
        self.state.token_mask.zero_()
        self._mask_dirty = False
        self.state.active = True

    def deactivate(self) -> None:
        """After :meth:`prepare_profile`: the next forwards run no adapter matmuls until a
        step asks for adapters (the mask is all zeros already), unless :meth:`keep_active`."""
        self.state.active = self._always_active

    def keep_active(self) -> None:
        """Run the adapter matmuls in every forward from now on, also in steps without
        adapters (over all-zero mask rows). For ``--torch-compile``: the wrappers' skip is a
        Python branch, so a compiled forward would otherwise exist in two variants, and the
        first step of the other kind would compile anew while serving."""
        self._always_active = True
        self.state.active = True
        # Its row count is fixed: else torch would tie it to a forward's token count when
        # they are equal (duck sizing) and compile again for any other count.
        torch._dynamo.mark_static(self.state.token_mask)

    def _check_rows(self, num_tokens: int) -> None:
        # The mask is never reallocated: captured graphs read it at its address.
        if num_tokens > self.state.token_mask.shape[0]:
            raise RuntimeError(
                f"a forward of {num_tokens} tokens, more than the {self.state.token_mask.shape[0]} "
                "the LoRA token mask was sized for (max_num_tokens)"
            )
