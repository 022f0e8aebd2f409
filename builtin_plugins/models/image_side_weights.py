"""Loading a multimodal checkpoint's image side beside its language model.

The classes of LLaVA, LLaVA-NeXT, InternVL, Mistral 3 and Gemma 3 build a vision tower and a projector
(modules named ``vision_tower`` and ``multi_modal_projector``) on top of a text-only class that
loads the language model (renaming its tensors). :class:`ImageSideWeights` is what they share:
which checkpoint tensors are read, how the image side's tensors are copied in (whole on every
tensor-parallel rank, shapes checked), and that LoRA adapters never reach the image side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn


def renamed_by_prefix(name: str, prefixes: Iterable[tuple[str, str]]) -> str | None:
    """Checkpoint tensor ``name`` with the first matching ``(checkpoint prefix, ours)`` of
    ``prefixes`` swapped for ours; ``None`` when none matches (a language-model tensor). What
    an :meth:`ImageSideWeights.image_side_name` made of a table of prefixes returns."""
    for prefix, ours in prefixes:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


class ImageSideWeights:
    """Mixin, listed before the text-only class it extends, for a model whose image side
    loads from the checkpoint.

    A subclass maps checkpoint names with :meth:`image_side_name` (``None``: a language
    model tensor, left to the text-only class; ``""``: an image-side tensor never read) and
    may leave out tensors of parts it did not build (:meth:`image_tensor_unused`).
    """

    #: the image side's module prefixes (every one of its parameters' names starts with one)
    image_modules: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")
    #: what error messages call the image side
    image_side_label: ClassVar[str] = "vision tower or projector"

    @staticmethod
    def image_side_name(name: str) -> str | None:
        """The image-side parameter a checkpoint tensor fills, ``""`` for an image-side
        tensor never read, ``None`` for a language-model tensor."""
        raise NotImplementedError

    def image_tensor_unused(self, ours: str) -> bool:
        """Whether image-side parameter name ``ours`` belongs to a part not built (a tower
        layer past the selected features); nothing by default."""
        return False

    def _skips(self, ours: str) -> bool:
        return not ours or self.image_tensor_unused(ours)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """The image side's tensors that what is built uses; the text-only class decides
        for the language model's."""
        ours = self.image_side_name(name)
        if ours is not None:
            return not self._skips(ours)
        return super().needs_checkpoint_tensor(name)  # type: ignore[misc]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors to the text-only class (renamed there); the image
        side's, whole on every rank, into its modules. ``ValueError`` for an image-side
        tensor without a parameter or of another shape."""
        params = dict(self.named_parameters())  # type: ignore[attr-defined]
        image_params = {n: p for n, p in params.items() if n.startswith(self.image_modules)}
        filled: set[str] = set()

        def language_model() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = self.image_side_name(name)
                if ours is None:
                    yield name, tensor
                    continue
                if self._skips(ours):
                    continue
                param = image_params.get(ours)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in the "
                        f"{self.image_side_label}; is the checkpoint's architecture right?"
                    )
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(param.shape)} (does config.json match the weights?)"
                    )
                param.copy_(tensor)
                filled.add(ours)

        return super().load_weights(language_model()) | filled  # type: ignore[misc]

    def lora_slices(self, module_name: str, module: nn.Module) -> list[Any]:
        """The language model's projections only: adapters never change the image side."""
        if module_name.startswith(self.image_modules):
            return []
        return super().lora_slices(module_name, module)  # type: ignore[misc]
