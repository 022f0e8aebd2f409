"""The ``"tiles"`` image-embeddings form's checks in the front-end
(:func:`chassis.core.multimodal_embeds.precomputed_items`), without a model: ``aspect_ratios``
is ``[images, 2]`` (or one image's ``[2]``); another shape, a ragged list or one of no numbers
is a ``ValueError`` rather than re-read as pairs (``[[1, 2, 1, 1]]`` is not two images), and
so is the grid form's ``image_grid_thw`` of another shape than ``[images, 3]``. Through ``LLM``: tests/test_image_embeds_llama4.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from chassis.builtin_plugins.models.llama4_processing import tiles_per_image
from chassis.core.multimodal_embeds import precomputed_items

CONFIG = SimpleNamespace(hidden_size=8)


class _Tiles:
    image_embeds_form = "tiles"
    image_embeds_tiles = staticmethod(tiles_per_image)  # (Llama 4's: a global tile after several)


def items(aspect_ratios: Any, rows: int = 12) -> list[tuple[int, list[list[int]]]]:
    item = {"image_embeds": torch.zeros(rows, 8), "aspect_ratios": aspect_ratios}
    out = precomputed_items([item], _Tiles, CONFIG, "m")
    return [(i.length, i.tensors["aspect_ratios"].tolist()) for i in out]


def test_images_split_by_their_grids() -> None:
    # a 1x2 grid (2 tiles and the global one) then one tile: 4 tiles of 3 rows
    assert items([[1, 2], [1, 1]]) == [(9, [[1, 2]]), (3, [[1, 1]])]
    assert items(torch.tensor([[1, 2], [1, 1]])) == [(9, [[1, 2]]), (3, [[1, 1]])]
    assert items([2, 2], rows=10) == [(10, [[2, 2]])]  # one image's [2]


@pytest.mark.parametrize(
    "aspect_ratios",
    [
        [[1, 2, 1, 1]],
        [[[1, 2]], [[1, 1]]],
        [1, 2, 1, 1],
        2,
        torch.tensor(2),
        [[1, 2], [1]],
        [None, 1],
    ],
)
def test_other_shapes_are_refused(aspect_ratios: Any) -> None:
    with pytest.raises(ValueError, match=r"aspect_ratios must be integers \[images, 2\]"):
        items(aspect_ratios)


class _Grid:
    image_embeds_form = "grid"


def test_a_grid_of_another_shape_is_refused() -> None:
    config = SimpleNamespace(hidden_size=8, vision_config={"spatial_merge_size": 2})
    item = {"image_embeds": torch.zeros(1, 8), "image_grid_thw": [[1, 2, 2]]}
    [one] = precomputed_items([item], _Grid, config, "m")
    assert one.length == 1
    for grid in ([[1, 2, 2, 1, 2, 2]], [1, 2, 2, 1, 2, 2], [[1, 2], [2]]):
        with pytest.raises(ValueError, match=r"image_grid_thw must be integers \[images, 3\]"):
            precomputed_items([{**item, "image_grid_thw": grid}], _Grid, config, "m")
