"""The language model of a multimodal checkpoint, served as text only.

A multimodal checkpoint's config nests its language model's config as ``text_config``; the
engine builds from and sizes by that
(:func:`~chassis.core.model_loader.language_model_config`). :class:`TextOnlyWeights` is the
mixin of the classes registered for such checkpoints: it renames the language model's
tensors to the text-only layout of the decoder class it is mixed into and leaves the image
side (vision tower, projector) unread, so no vision weight is ever read from disk. Images are
not accepted: a chat message with an image part is refused before it reaches the model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch


class TextOnlyWeights:
    """Mixin (listed before the decoder class) that loads a multimodal checkpoint's language
    model into a text-only decoder.

    Subclasses set :attr:`language_model_prefixes` and :attr:`vision_prefixes`. A checkpoint
    name outside both is passed on unchanged (the decoder's ``load_weights`` then takes it or
    raises for it).
    """

    #: (checkpoint-name prefix, ours), the first that matches applies
    language_model_prefixes: tuple[tuple[str, str], ...] = ()
    #: checkpoint-name prefixes of the image side, never read
    vision_prefixes: tuple[str, ...] = ()

    def is_vision_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to the image side (not loaded)."""
        return name.startswith(self.vision_prefixes)

    def language_model_name(self, name: str) -> str:
        """Checkpoint name -> the text-only decoder's name for it."""
        for prefix, ours in self.language_model_prefixes:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name

    def lora_module_aliases(self, hf_module: str) -> tuple[str, ...]:
        """The checkpoint's names of a language-model projection (adapters trained on the
        multimodal model name it so: ``model.language_model.layers.0.self_attn.q_proj``)."""
        return checkpoint_aliases(hf_module, self.language_model_prefixes)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """No image-side tensor is read from disk; the decoder decides for the others (by
        their text-only name)."""
        if self.is_vision_tensor(name):
            return False
        return super().needs_checkpoint_tensor(self.language_model_name(name))  # type: ignore[misc]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors, renamed, to the decoder's ``load_weights`` (image-side
        tensors, should a caller pass them, are dropped)."""
        renamed = (
            (self.language_model_name(name), tensor)
            for name, tensor in weights
            if not self.is_vision_tensor(name)
        )
        return super().load_weights(renamed)  # type: ignore[misc]


def wrapper_tie_word_embeddings(hf_config: Any) -> Any:
    """``hf_config`` with ``tie_word_embeddings`` set to the multimodal wrapper config's value
    where :func:`~chassis.core.model_loader.language_model_config` recorded one
    (``wrapper_tie_word_embeddings``) and it differs; ``hf_config`` itself otherwise.

    For the Qwen VL checkpoints transformers ties the LM head by the wrapper's flag (the one
    their config.json sets), whatever the text config's class defaults to.
    """
    wrapper = getattr(hf_config, "wrapper_tie_word_embeddings", None)
    if wrapper is None or bool(wrapper) == bool(getattr(hf_config, "tie_word_embeddings", False)):
        return hf_config
    hf_config = copy.copy(hf_config)
    hf_config.tie_word_embeddings = bool(wrapper)
    return hf_config


def checkpoint_aliases(name: str, prefixes: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The checkpoint names that ``prefixes`` ((checkpoint prefix, ours) pairs) map to the
    module name ``name``, other than ``name`` itself."""
    aliases = [
        prefix + name[len(ours) :]
        for prefix, ours in prefixes
        if name.startswith(ours) and prefix + name[len(ours) :] != name
    ]
    return tuple(dict.fromkeys(aliases))
