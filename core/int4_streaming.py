"""Packing a 4-bit checkpoint's layers one at a time while it loads, so that the whole
dequantized model never exists.

Two steps around the model's construction and its ``load_weights``:

1. :func:`deferred_linear_weights`, around the constructor: each ``nn.Linear`` built inside
   gets its weight on the meta device (no memory; the full-size tensor ``nn.Linear``
   allocates is dropped at once, and its random initialisation does nothing).
   :meth:`Int4StreamPacker.__init__` then gives real (uninitialised) weights back to every
   such layer that no packed checkpoint module loads into (``lm_head``, modules left
   unquantized), and the others a one-element placeholder of their shape.
2. :meth:`Int4StreamPacker.stream` wraps the tensors passed to ``load_weights``: a deferred
   layer gets its weight (model dtype, this rank's shape) just before the first tensor that
   loads into it, and once every packed checkpoint module of the layer has been loaded
   (``load_weights`` asked for the next tensor), the layer is packed by the exact comparison of
   :func:`~chassis.core.int4_packing.pack_int4_linear` and its weight freed; those modules'
   packed tensors are dropped from :class:`~chassis.core.int4_packing.Int4Sources`.

The model's own ``load_weights`` thus still merges projections and cuts tensor-parallel
shares as for any checkpoint, and each packed layer is proven to reproduce the weight it
loaded, bit for bit. At any time the loader holds the packed layers so far, the tensors that
are not packed (embeddings, norms, heads), and the one layer being loaded (its weight, its
modules' float32 dequantized weights and packed tensors): no longer the whole dequantized
model plus every packed tensor. A layer whose packed tensors do not reproduce it keeps its
weight (dequantized), as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from chassis.core.int4_packing import (
    Int4Sources,
    Packed,
    layer_of,
    pack_int4_linear,
    warn_kept_dequantized,
)
from chassis.core.weights import checkpoint_keys


class DeferredLinears:
    """The ``nn.Linear`` layers built inside :func:`deferred_linear_weights` whose weight
    was put on the meta device, and the device each would have had."""

    def __init__(self) -> None:
        self.devices: dict[nn.Linear, torch.device] = {}
        #: layers given a one-element placeholder (:meth:`hold`) until :meth:`materialize`
        self.held: set[nn.Linear] = set()

    def hold(self, layer: nn.Linear) -> None:
        """Give a deferred ``layer`` a placeholder weight on its device: its shape and dtype
        over one element (stride 0). A loader that looks the parameter up before reading any
        tensor (``dict(model.named_parameters())``) then keeps the parameter
        :meth:`materialize` fills in place (a meta tensor's data cannot be swapped for a real
        one's)."""
        device = self.devices.pop(layer, None)
        if device is None:
            return
        meta = layer.weight
        placeholder = torch.empty(1, dtype=meta.dtype, device=device).expand(meta.shape)
        layer.weight = nn.Parameter(placeholder, requires_grad=meta.requires_grad)
        self.held.add(layer)

    def materialize(self, layer: nn.Linear) -> None:
        """Give ``layer`` an uninitialised weight of its shape and dtype on its device (the
        loader fills it), the same parameter object when it held a placeholder; nothing for
        a layer not deferred or already given one."""
        self.hold(layer)
        if layer not in self.held:
            return
        self.held.discard(layer)
        weight = layer.weight
        weight.data = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


@contextlib.contextmanager
def deferred_linear_weights() -> Iterator[DeferredLinears]:
    """Inside: every ``nn.Linear`` constructed gets its weight on the meta device (a weight
    created on the meta device, or a parameter assigned to a layer later, such as a tied
    embedding, is left alone). Not thread-safe: torch's parameter-registration hook is
    global to the process, which constructs its model alone."""
    deferred = DeferredLinears()

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        # nn.Linear.__init__ registers a fresh weight: the module has none yet
        if (
            type(module) is not nn.Linear
            or name != "weight"
            or param is None
            or "weight" in module._parameters
            or param.device.type == "meta"
        ):
            return None
        deferred.devices[module] = param.device
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(hook)
    try:
        yield deferred
    finally:
        handle.remove()


def packed_checkpoint_modules(
    model_dir: Path, wanted: Callable[[str], bool] | None = None, load_format: str = "auto"
) -> set[str]:
    """The modules of the checkpoint in ``model_dir`` stored packed (those with a
    ``qweight``), read from the files ``load_format`` picks (safetensors: their headers;
    ``.bin``: the memory-mapped state dicts); ``wanted(name)``, when given, keeps only the
    tensors the loader reads."""
    return {
        name.removesuffix(".qweight")
        for name in checkpoint_keys(model_dir, load_format)
        if name.endswith(".qweight") and (wanted is None or wanted(name))
    }


class Int4StreamPacker:
    """Packs a model's 4-bit layers as :meth:`stream` feeds its ``load_weights`` (module
    docstring).

    :param model: built inside :func:`deferred_linear_weights` (``deferred``)
    :param sources: records each packed checkpoint module as it is dequantized (its
        ``record`` must be the dequantization's ``on_module``)
    :param packed_modules: the checkpoint's packed modules the loader will read
        (:func:`packed_checkpoint_modules`)
    """

    def __init__(
        self,
        model: nn.Module,
        deferred: DeferredLinears,
        sources: Int4Sources,
        packed_modules: set[str],
        merged_projections: dict[str, str] | None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.model = model
        self.deferred = deferred
        self.sources = sources
        self.merged = merged_projections
        self.tp_size, self.tp_rank = tp_size, tp_rank
        modules = dict(model.named_modules())
        #: layer name -> the packed checkpoint modules not yet loaded into it
        self.waiting: dict[str, set[str]] = {}
        for name in packed_modules:
            layer = layer_of(name, merged_projections)
            if type(modules.get(layer)) is nn.Linear:
                self.waiting.setdefault(layer, set()).add(name)
        #: layer name -> its packed modules' tensors recorded so far
        self.candidates: dict[str, dict[str, Packed]] = {}
        self.packed = 0
        self.kept: list[str] = []
        for name, module in modules.items():
            if not isinstance(module, nn.Linear):
                continue
            if name in self.waiting:
                deferred.hold(module)
            else:
                deferred.materialize(module)

    def stream(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` as they are, packing each layer once its last packed module was
        loaded (see the class docstring)."""
        for name, tensor in weights:
            base = name.rpartition(".")[0]
            layer = layer_of(base, self.merged)
            if layer in self.waiting:
                module = self.model.get_submodule(layer)
                if isinstance(module, nn.Linear):
                    self.deferred.materialize(module)
            yield name, tensor
            del tensor
            # load_weights has loaded ``name`` (it asks for the next tensor only then)
            self._arrived(base, layer)
        self.finish()

    def _arrived(self, base: str, layer: str) -> None:
        packed = self.sources.modules.pop(base, None)
        if packed is None:
            return
        waiting = self.waiting.get(layer)
        if waiting is None or base not in waiting:
            return  # a module no nn.Linear holds (fused MoE experts): never packed
        waiting.discard(base)
        self.candidates.setdefault(layer, {})[base] = packed
        if not waiting:
            self._pack(layer)

    @torch.no_grad()
    def _pack(self, layer: str) -> None:
        del self.waiting[layer]
        candidates = self.candidates.pop(layer)
        if pack_int4_linear(self.model, layer, candidates, self.merged, self.tp_size, self.tp_rank):
            self.packed += 1
        else:
            self.kept.append(layer)

    def finish(self) -> None:
        """After the last tensor: a layer some of whose packed modules never came is given
        its weight (it stays dequantized; the loader reports what was not loaded), and the
        layers kept dequantized are logged once."""
        for layer in list(self.waiting):
            module = self.model.get_submodule(layer)
            if isinstance(module, nn.Linear):
                self.deferred.materialize(module)
            if layer in self.candidates:
                self._pack(layer)
            else:
                del self.waiting[layer]
        warn_kept_dequantized(self.kept)
        self.kept = []
