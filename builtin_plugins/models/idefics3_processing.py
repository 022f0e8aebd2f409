"""Idefics3 / SmolVLM images -> the model's inputs, as transformers' ``Idefics3Processor`` /
``SmolVLMProcessor`` over their image processors (the PIL backend), in PIL and numpy.

Pixels (``preprocessor_config.json``; ``L`` = ``size["longest_edge"]``, ``M`` =
``max_image_size["longest_edge"]``, every resize PIL's on uint8 with ``resample``, Lanczos
by default):

1. RGB (transparency over white);
2. with ``do_resize``: the longest side becomes ``L`` (the other ``int(side * L / longest)``,
   rounded up to an even number), then both capped at 4096 the same way (no rounding);
3. with ``do_image_splitting``: both sides rounded up to multiples of ``M`` (the longer
   first, the shorter from ``int`` of the aspect ratio, then rounded up), the image resized to
   that; when it is larger than ``M x M`` it is cut into ``rows x cols`` tiles of ``M x M``,
   row-major, followed by the global image (the resized image scaled to ``M x M``); else it is
   the one tile. Without splitting, the image scaled to ``M x M`` is the one tile;
4. each tile ``* rescale_factor`` and ``(x - mean) / std``.

Prompt: one ``<image>`` token (the config's ``image_token_id``) stands for an image; it
expands, as the processors write it, to ``<fake_token_around_image><global-img>`` and
``image_seq_len`` ``<image>`` tokens and ``<fake_token_around_image>`` for one tile; for a
grid, per row ``(<fake_token_around_image><row_r_col_c>`` and ``image_seq_len`` ``<image>``
tokens``)`` per column then ``\\n``, then ``\\n`` and the global image's part as above. The
text is tokenized whole, as HF tokenizes it. The feature covers the whole run and carries its
token ids (``placeholder_ids``): the model returns one row per token of it.
``image_seq_len`` (``processor_config.json``, 169 by default) must be the model's rows per
tile. No per-request processor kwargs are taken.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.idefics3_vision import Idefics3VisionSpec
from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_processing import ClipPreprocessing, rgb_channels
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)
from chassis.builtin_plugins.models.run_writing_processor import RunWritingProcessor
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_processing import MultiModalProcessor

_PROCESSOR_TYPES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
_LANCZOS = 1
_MAX_SIDE = 4096  # transformers' cap on a resized side
_IMAGE_TOKEN = "<image>"
_FAKE_TOKEN = "<fake_token_around_image>"
_GLOBAL_TAG = "<global-img>"
_DEFAULT_SEQ_LEN = 169


def _longest_edge(value: Any, name: str) -> int:
    if not isinstance(value, Mapping) or not isinstance(value.get("longest_edge"), int):
        raise ValueError(f"{name} {value!r} is not supported (a longest_edge only)")
    edge = int(value["longest_edge"])
    if edge < 1:
        raise ValueError(f"{name} longest_edge must be positive; got {edge}")
    return edge


def longest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(height, width) of an image resized so its longest side is ``edge`` (step 2)."""
    aspect = width / height
    if width >= height:
        width, height = edge, int(edge / aspect)
        height += height % 2
    else:
        height, width = edge, int(edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / aspect)
    elif height > width and height > _MAX_SIDE:
        height, width = _MAX_SIDE, int(_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of ``tile`` (step 3)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


class Idefics3Tiles:
    """Steps 1-4 of the module docstring for one checkpoint."""

    def __init__(
        self,
        longest_edge: int | None,
        tile: int,
        split: bool,
        resample: int,
        steps: ClipPreprocessing,
    ) -> None:
        self.longest_edge = longest_edge
        self.tile = tile
        self.split = split
        self.resample = resample
        self.steps = steps

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Idefics3Tiles:
        """The steps of an Idefics3 / SmolVLM image processor config; ``ValueError`` for
        another processor type or a setting not followed."""
        kind = str(config.get("image_processor_type") or _PROCESSOR_TYPES[0])
        if kind.removesuffix("Fast").removesuffix("Pil") not in _PROCESSOR_TYPES:
            raise ValueError(
                f"image processor {kind!r} is not supported for Idefics3 images; supported: "
                f"{', '.join(_PROCESSOR_TYPES)}"
            )
        settings = {k: v for k, v in config.items() if v is not None}

        def flag(name: str) -> bool:
            return bool(settings.get(name, True))

        tile = _longest_edge(
            settings.get("max_image_size", {"longest_edge": 364}), "max_image_size"
        )
        edge = _longest_edge(settings.get("size", {"longest_edge": 4 * 364}), "size")
        steps = ClipPreprocessing(
            do_pad=False,
            pad_color=(0, 0, 0),
            resize=None,
            resample=int(settings.get("resample", _LANCZOS)),
            crop=None,
            rescale_factor=float(settings.get("rescale_factor", 1 / 255))
            if flag("do_rescale")
            else None,
            mean=rgb_channels(settings.get("image_mean", 0.5), "image_mean")
            if flag("do_normalize")
            else None,
            std=rgb_channels(settings.get("image_std", 0.5), "image_std")
            if flag("do_normalize")
            else None,
        )
        return cls(
            edge if flag("do_resize") else None,
            tile,
            flag("do_image_splitting"),
            steps.resample,
            steps,
        )

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of an image's grid; ``(0, 0)`` for one tile (HF's counts)."""
        if self.longest_edge is not None:
            height, width = longest_edge_size(height, width, self.longest_edge)
        if not self.split:
            return 0, 0
        height, width = tile_multiple_size(height, width, self.tile)
        if height <= self.tile and width <= self.tile:
            return 0, 0
        return height // self.tile, width // self.tile

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[tiles, 3, M, M]`` float32 pixels."""
        image = to_rgb(image)
        side = self.tile
        if self.longest_edge is not None:
            height, width = longest_edge_size(image.height, image.width, self.longest_edge)
            image = image.resize((width, height), resample=self.resample)
        if not self.split:
            tiles = [image.resize((side, side), resample=self.resample)]
        else:
            height, width = tile_multiple_size(image.height, image.width, side)
            image = image.resize((width, height), resample=self.resample)
            if height <= side and width <= side:
                tiles = [image]
            else:
                tiles = [
                    image.crop((col * side, row * side, (col + 1) * side, (row + 1) * side))
                    for row in range(height // side)
                    for col in range(width // side)
                ]
                tiles.append(image.resize((side, side), resample=self.resample))
        return np.stack([self.steps(tile) for tile in tiles])


class Idefics3ImageInputs(RunWritingProcessor, MultiModalProcessor):
    """Images of Idefics3 / SmolVLM requests (the module docstring)."""

    def __init__(
        self, tiles: Idefics3Tiles, image_seq_len: int, image_token_id: int, tokenizer: Any
    ) -> None:
        self.tiles = tiles
        self.image_seq_len = image_seq_len
        self.image_token_id = image_token_id
        self.tokenizer = tokenizer
        self.placeholder_token_ids = {"image": image_token_id}
        self._runs: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Idefics3ImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its
        ``preprocessor_config.json``, ``processor_config.json`` and tokenizer) for the model
        of ``hf_config``; ``ValueError`` when something is missing, not supported, or does not
        agree with the model."""
        from chassis.core.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = Idefics3VisionSpec.from_config(hf_config)
        tiles = Idefics3Tiles.from_dict(json.loads(path.read_text()))
        saved = saved_processor_config(model_dir)
        seq_len = int(saved.get("image_seq_len") or _DEFAULT_SEQ_LEN)
        unit = spec.patch_size * spec.shuffle
        if tiles.tile % unit or spec.rows_per_tile(tiles.tile) != seq_len:
            raise ValueError(
                f"the processor writes {seq_len} image tokens per {tiles.tile}-pixel tile, but "
                f"the model gives {spec.rows_per_tile(tiles.tile)} rows for it (tiles must be "
                f"multiples of {unit} pixels)"
            )
        tokenizer = load_tokenizer(model_dir)
        image_token_ids(tokenizer, (_IMAGE_TOKEN, _FAKE_TOKEN), _IMAGE_TOKEN, image_token_id)
        return cls(tiles, seq_len, image_token_id, tokenizer)

    def prompt_placeholder(self, modality: str) -> str:
        return _IMAGE_TOKEN

    def run_text(self, rows: int, cols: int) -> str:
        """The expansion of an image of a ``rows x cols`` grid (``0, 0``: one tile)."""
        image = _IMAGE_TOKEN * self.image_seq_len
        global_part = f"{_FAKE_TOKEN}{_GLOBAL_TAG}{image}{_FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return global_part
        grid = "".join(
            "".join(f"{_FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{global_part}"

    def placeholder_ids(self, rows: int, cols: int) -> list[int]:
        """The token run of an image of a ``rows x cols`` grid (module docstring)."""
        run = self._runs.get((rows, cols))
        if run is None:
            run = self.tokenizer.encode(self.run_text(rows, cols), add_special_tokens=False)
            self._runs[(rows, cols)] = run
        return list(run)

    def num_tokens(self, height: int, width: int) -> int:
        """Prompt tokens of an image of ``height x width`` pixels once expanded."""
        return len(self.placeholder_ids(*self.tiles.grid(height, width)))

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.tiles)
        run = self.placeholder_ids(*self.tiles.grid(item.height, item.width))
        if sum(1 for t in run if t == self.image_token_id) != pixels.shape[0] * self.image_seq_len:
            # (a guard: grid() and the tiling compute the same sizes)
            raise ValueError("the image's tiles do not match its prompt run")
        return len(run), {
            "pixel_values": torch.from_numpy(pixels),
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
