"""The front-end's multimodal processor: a prompt's placeholders and its items in, the
expanded prompt and one :class:`~chassis.core.multimodal.MultiModalFeature` per item out.

A model that takes images returns one from its ``multimodal_processor`` classmethod
(:meth:`chassis.core.model_interface.CausalLM.multimodal_processor`); the input processor
(:mod:`chassis.core.input_processor`) builds it on the first request that carries items and
runs every such request through :meth:`MultiModalProcessor.process`.

Contract (vLLM's prompt convention): the prompt holds ONE placeholder token per item
(:attr:`MultiModalProcessor.placeholder_token_ids`, e.g. Qwen2-VL's ``<|image_pad|>``), in
item order; :meth:`~MultiModalProcessor.process` replaces each by as many copies as the
model's encoder returns rows for the item, and describes where they sit. A processor may
override :meth:`~MultiModalProcessor.process` to write other tokens inside an item's run
(Mistral 3 ends each row of ``[IMG]`` tokens with ``[IMG_BREAK]`` and the image with
``[IMG_END]``): the feature then covers the whole run and the model's ``embed_multimodal``
returns one row per token of it (:mod:`chassis.core.placeholder_runs`). Every refusal is a
``ValueError`` a client can act on (the server's 400).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from chassis.core.multimodal import MultiModalFeature, make_feature
from chassis.core.multimodal_embeds import PrecomputedItem
from chassis.core.multimodal_item_cache import ProcessedItemCache


class MultiModalProcessor(ABC):
    """Turns a request's items (images) into the model's inputs, one item at a time."""

    #: modality -> the token id that stands for one item in a prompt before expansion (and
    #: that each of the item's expanded placeholder tokens carries)
    placeholder_token_ids: Mapping[str, int]
    #: the engine's cache of processed items (``--mm-processor-cache-gb``), set by the
    #: front-end that builds the processor; ``None``: every item is processed
    item_cache: ProcessedItemCache | None = None

    @abstractmethod
    def prompt_placeholder(self, modality: str) -> str:
        """The text that stands for one item in a prompt (what a chat message's item
        becomes when the chat template takes content as one string), holding the
        placeholder token once: Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``."""

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) per-request processor kwargs (vLLM's
        ``mm_processor_kwargs``) this processor does not honour; by default any."""
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs are not supported by this model; got {sorted(kwargs)}"
            )

    @abstractmethod
    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """One item (a ``PIL.Image.Image`` for ``"image"``) processed for the model, with the
        request's checked ``kwargs``: its number of placeholder tokens (rows of the encoder's
        output) and its tensors (:attr:`MultiModalFeature.data`). ``ValueError`` for an
        item it cannot take."""

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The expanded prompt and one feature per item, in prompt order.

        ``items`` maps each modality to its items in order (``{"image": [img, ...]}``); the
        prompt must hold exactly one placeholder token per item of each modality given, and
        ``kwargs`` are the request's ``mm_processor_kwargs``. ``ValueError`` for a modality
        the model does not take, a placeholder count that differs from the item count, bad
        kwargs, or an item :meth:`process_item` refuses.
        """
        kwargs = dict(kwargs or {})
        self.check_kwargs(kwargs)
        token_modality: dict[int, str] = {}
        for modality, modality_items in items.items():
            token = self.placeholder_token_ids.get(modality)
            if token is None:
                known = ", ".join(sorted(self.placeholder_token_ids)) or "none"
                raise ValueError(f"this model does not take {modality} inputs (it takes: {known})")
            count = sum(1 for t in prompt_token_ids if t == token)
            if count != len(modality_items):
                raise ValueError(
                    f"the prompt has {count} {modality} placeholder(s) "
                    f"({self.prompt_placeholder(modality)!r}, token id {token}) but "
                    f"{len(modality_items)} {modality}(s) were given: put one placeholder per "
                    f"{modality} in the prompt, in the order of the {modality}s"
                )
            token_modality[token] = modality
        processed = {
            modality: [self._process_one(modality, item, kwargs) for item in modality_items]
            for modality, modality_items in items.items()
        }
        next_item = dict.fromkeys(items, 0)
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        for token in prompt_token_ids:
            modality = token_modality.get(token)
            if modality is None:
                expanded.append(token)
                continue
            length, tensors = processed[modality][next_item[modality]]
            next_item[modality] += 1
            features.append(make_feature(modality, len(expanded), length, tensors))
            expanded.extend([token] * length)
        return expanded, features

    def precomputed_item(
        self, modality: str, item: PrecomputedItem
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """An item whose rows the caller gave (image embeddings, one image's rows under
        ``image_embeds``): its placeholder count and tensors, as :meth:`process_item` returns
        them. By default one placeholder token per row, the tensors as they are; a processor
        whose model takes only some row counts refuses others (``ValueError``), and one that
        writes token runs (:mod:`chassis.core.placeholder_runs`) returns the run's length
        and adds its ids: the model's ``embed_multimodal`` then receives the rows with the
        run and splices them in (no tower)."""
        return item.length, item.tensors

    def _process_one(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """:meth:`process_item` (through :attr:`item_cache` when there is one), or an item
        whose rows the caller gave (image embeddings, :mod:`chassis.core.multimodal_embeds`)
        as it is."""
        if isinstance(item, PrecomputedItem):
            return self.precomputed_item(modality, item)
        if self.item_cache is not None:
            return self.item_cache.get_or_process(modality, item, kwargs, self.process_item)
        return self.process_item(modality, item, kwargs)
