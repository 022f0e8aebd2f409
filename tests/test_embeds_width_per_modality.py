"""core/multimodal_embeds.py: a model class's ``image_embeds_width`` (Qwen3-VL's rows carry
its deepstack rows) sets the width of image embeddings only; audio embeddings of a class
that takes both stay the language model's hidden size wide."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chassis.core.multimodal_embeds import PrecomputedItem, precomputed_items


class _ImagesAndAudio:
    """A class taking embeddings of both modalities, its image rows 3x the hidden size."""

    image_embeds_form = "rows"
    audio_embeds_form = "rows"

    @classmethod
    def image_embeds_width(cls, hf_config: object) -> int:
        return 3 * int(hf_config.hidden_size)  # type: ignore[attr-defined]


CONFIG = SimpleNamespace(hidden_size=8)


def test_audio_rows_are_the_hidden_size_wide() -> None:
    [item] = precomputed_items([torch.zeros(5, 8)], _ImagesAndAudio, CONFIG, "m", "audio")
    assert isinstance(item, PrecomputedItem) and item.length == 5
    with pytest.raises(ValueError, match="hidden size 8"):
        precomputed_items([torch.zeros(5, 24)], _ImagesAndAudio, CONFIG, "m", "audio")


def test_image_rows_take_the_class_width() -> None:
    [item] = precomputed_items([torch.zeros(5, 24)], _ImagesAndAudio, CONFIG, "m", "image")
    assert isinstance(item, PrecomputedItem) and item.length == 5
    with pytest.raises(ValueError, match="image embedding width"):
        precomputed_items([torch.zeros(5, 8)], _ImagesAndAudio, CONFIG, "m", "image")
