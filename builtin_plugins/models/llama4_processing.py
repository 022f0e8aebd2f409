"""Llama 4 images -> the model's inputs, as transformers' ``Llama4Processor`` over its
``Llama4ImageProcessorFast`` (a torchvision processor; here PIL and torch).

Tiles (``preprocessor_config.json``: ``size`` ``S`` square and the tower's ``image_size``,
``max_patches`` ``M``, ``resize_to_max_canvas``):

1. RGB (transparency over white);
2. the canvas: of the ``h x w`` grids of at most ``M`` tiles (``S``-pixel sides), the one
   the image fits best without distortion (:func:`best_canvas`: the smallest upscale, else
   the mildest downscale; the smallest area on a tie);
3. the image resized (PIL bilinear) to fit the canvas without distortion, never upscaled
   past ``max(side, S)`` per side unless ``resize_to_max_canvas``
   (:func:`resized_size`), padded with black right and bottom to the canvas;
4. ``* rescale_factor`` and ``(x - mean) / std`` in bfloat16, as HF's processor does (kept as
   float32 here), cut into ``h * w`` tiles row-major; with more than one tile, a global tile
   (the whole image resized to ``S x S``) after them.

The resize is PIL's where HF's is torchvision's (both bilinear, antialiased): pixels may
differ by a rounding step. The canvas, and therefore the prompt, is HF's.

Prompt: ``<|image|>`` (``processor_config.json``'s ``fake_image_token``; what the chat
template writes for an image part) stands for an image;
it becomes, as ``Llama4Processor`` writes it, ``<|image_start|>``, then with several tiles
each grid row's tiles as ``N`` ``<|patch|>`` tokens each, ``<|tile_x_separator|>`` between
them and ``<|tile_y_separator|>`` after the row, then ``<|image|>``, the global tile's (or
the only tile's) ``N`` ``<|patch|>`` tokens and ``<|image_end|>``. ``N`` is
``(S // patch_size)**2 // round(1 / pixel_shuffle_ratio**2)`` (``processor_config.json``;
transformers' defaults 14 and 0.5) and must be the tower's rows per tile. The feature covers
the whole run and carries its ids (``placeholder_ids``): the model returns one row per token
of it, the tiles' rows at the ``<|patch|>`` tokens (the config's ``image_token_id``). No
per-request processor kwargs are taken.

Image embeddings (``--enable-mm-embeds``, the ``"tiles"`` form of
:mod:`chassis.core.multimodal_embeds`): an image's tiles' rows (the grid's, then the global
tile) with its ``aspect_ratios`` (tile rows and columns) are written as the run of an image of
that grid (:meth:`Llama4ImageInputs.precomputed_item`); rows alone are one tile's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llama4_vision import Llama4VisionSpec
from chassis.builtin_plugins.models.llava_processing import rgb_channels
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)
from chassis.builtin_plugins.models.run_writing_processor import RunWritingProcessor
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_embeds import ASPECT_KEY, EMBEDS_KEY, PrecomputedItem
from chassis.core.multimodal_processing import MultiModalProcessor

_PROCESSOR_TYPE = "Llama4ImageProcessor"
_BILINEAR = 2
#: ``Llama4Processor``'s defaults for what ``processor_config.json`` leaves out
_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "pixel_shuffle_ratio": 0.5,
    "fake_image_token": "<|image|>",
}
#: the tokens of an image's run (``Llama4Processor`` writes these texts whatever its settings)
START, IMAGE, PATCH, END = "<|image_start|>", "<|image|>", "<|patch|>", "<|image_end|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
_RUN_TOKENS = (START, IMAGE, PATCH, TILE_X, TILE_Y, END)


def canvases(max_tiles: int) -> list[tuple[int, int]]:
    """The ``(rows, cols)`` grids of at most ``max_tiles`` tiles, in transformers' order
    (grouped by aspect ratio, groups in order of first appearance counting down from
    ``max_tiles`` tiles; within a group, by falling tile count)."""
    groups: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            groups.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [grid for group in groups.values() for grid in group]


def best_canvas(
    height: int, width: int, tile: int, max_tiles: int, to_max: bool = False
) -> tuple[int, int]:
    """``(rows, cols)`` of the canvas an image of ``height x width`` goes on (module
    docstring, step 2): scales computed in float32 as transformers does, so ties fall the
    same way."""
    grids = canvases(max_tiles)
    sizes = torch.tensor(grids) * tile
    scale_h = sizes[:, 0] / height
    scale_w = sizes[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if to_max else up.min()
    else:
        chosen = scales[scales < 1].max()
    candidates = [i for i in range(len(grids)) if scales[i] == chosen]
    best = min(candidates, key=lambda i: grids[i][0] * grids[i][1])  # first on a tie
    return grids[best]


def resized_size(
    height: int, width: int, canvas: tuple[int, int], tile: int, to_max: bool = False
) -> tuple[int, int]:
    """``(height, width)`` the image is resized to on a ``canvas`` (in pixels): the largest
    that keeps its aspect ratio inside the canvas, capped at ``max(side, tile)`` per side
    unless ``to_max`` (module docstring, step 3).

    Arithmetic as transformers': a side whose target is the canvas's (a tensor there) is
    scaled in float32, one capped by the image or the tile (a Python int there) in float64;
    the floor of the scaled side can differ between the two."""
    targets = []
    for side, edge in zip((height, width), canvas, strict=True):
        cap = edge if to_max else max(side, tile)
        # transformers: min(cap, canvas edge) keeps the cap unless the canvas edge is smaller
        targets.append((edge, True) if to_max or edge < cap else (cap, False))

    def scale(target: tuple[int, bool], side: int) -> float:
        value, in_float32 = target
        return float(np.float32(value) / np.float32(side)) if in_float32 else value / side

    def scaled(side: int, factor: float, in_float32: bool) -> int:
        product = np.float32(side) * np.float32(factor) if in_float32 else side * factor
        return math.floor(product)

    (target_h, h32), (target_w, w32) = targets
    scale_h, scale_w = scale(targets[0], height), scale(targets[1], width)
    # (a float32 tensor compared with a Python float: in float32)
    narrower = np.float32(scale_w) < np.float32(scale_h) if h32 or w32 else scale_w < scale_h
    if narrower:
        new_h, new_w = min(scaled(height, scale_w, w32), target_h), target_w
    else:
        new_h, new_w = target_h, min(scaled(width, scale_h, h32), target_w)
    return max(new_h, 1), max(new_w, 1)


def tiles_per_image(grid_rows: int, grid_cols: int) -> int:
    """The tiles an image cut into ``grid_rows x grid_cols`` takes: the grid's, plus a global
    tile (the whole image) when there are several."""
    tiles = grid_rows * grid_cols
    return tiles + (tiles > 1)


class Llama4Tiles:
    """Steps 1-4 of the module docstring for one checkpoint's image processor settings."""

    def __init__(
        self,
        tile: int,
        max_tiles: int,
        to_max: bool,
        rescale_factor: float,
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        self.tile, self.max_tiles, self.to_max = tile, max_tiles, to_max
        self.rescale_factor = rescale_factor
        self.mean = torch.tensor(mean, dtype=torch.bfloat16).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.bfloat16).view(-1, 1, 1)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], side: int) -> Llama4Tiles:
        """The steps of a ``Llama4ImageProcessor`` config for a tower of ``side`` pixels;
        ``ValueError`` for another processor type or a setting not followed."""
        kind = str(config.get("image_processor_type") or _PROCESSOR_TYPE)
        if kind.removesuffix("Fast") != _PROCESSOR_TYPE:
            raise ValueError(
                f"image processor {kind!r} is not supported for Llama 4 images; supported: "
                f"{_PROCESSOR_TYPE}"
            )
        settings = {k: v for k, v in config.items() if v is not None}
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not settings.get(flag, True):
                raise ValueError(f"{flag} false is not supported for Llama 4 images")
        size = settings.get("size", {"height": 336, "width": 336})
        if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
            raise ValueError(f"size {size!r} is not supported (height and width)")
        if (int(size["height"]), int(size["width"])) != (side, side):
            raise ValueError(
                f"the image processor makes {size} tiles, but the vision tower takes "
                f"{side}x{side} (image_size)"
            )
        resample = int(settings.get("resample", _BILINEAR))
        if resample != _BILINEAR:
            raise ValueError(f"resample {resample} is not supported (bilinear, {_BILINEAR})")
        max_tiles = int(settings.get("max_patches", 16))
        if max_tiles < 1:
            raise ValueError(f"max_patches must be at least 1; got {max_tiles}")
        return cls(
            side,
            max_tiles,
            bool(settings.get("resize_to_max_canvas", False)),
            float(settings.get("rescale_factor", 1 / 255)),
            rgb_channels(settings.get("image_mean", 0.5), "image_mean"),
            rgb_channels(settings.get("image_std", 0.5), "image_std"),
        )

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of an image's tiles."""
        rows, cols = best_canvas(height, width, self.tile, self.max_tiles, self.to_max)
        return int(rows), int(cols)

    def _normalized(self, image: Any) -> torch.Tensor:
        """A PIL RGB image -> ``[3, H, W]`` rescaled and normalized in bfloat16."""
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
        scaled = pixels.to(torch.bfloat16) * self.rescale_factor
        return (scaled - self.mean) / self.std

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[tiles, 3, S, S]`` float32 pixels (the global tile last)."""
        from PIL import Image

        image = to_rgb(image)
        rows, cols = self.grid(image.height, image.width)
        side = self.tile
        canvas = (rows * side, cols * side)
        new_h, new_w = resized_size(image.height, image.width, canvas, side, self.to_max)
        padded = Image.new("RGB", (canvas[1], canvas[0]), (0, 0, 0))
        padded.paste(image.resize((new_w, new_h), resample=_BILINEAR), (0, 0))
        whole = self._normalized(padded)
        tiles = whole.reshape(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, side, side)
        if rows * cols > 1:
            global_tile = self._normalized(image.resize((side, side), resample=_BILINEAR))
            tiles = torch.cat([tiles, global_tile[None]])
        return tiles.float().numpy()


class Llama4ImageInputs(RunWritingProcessor, MultiModalProcessor):
    """Images of Llama 4 requests (the module docstring). ``ids`` maps the text of each
    token of a run, and ``image_text`` (the prompt's token for an image), to its id."""

    def __init__(
        self, tiles: Llama4Tiles, tokens_per_tile: int, ids: Mapping[str, int], image_text: str
    ) -> None:
        self.tiles = tiles
        self.tokens_per_tile = tokens_per_tile
        self.ids = dict(ids)
        self.image_text = image_text
        self.placeholder_token_ids = {"image": self.ids[image_text]}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Llama4ImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its
        ``preprocessor_config.json``, ``processor_config.json`` and tokenizer) for the model
        of ``hf_config``; ``ValueError`` when something is missing, not supported, or does not
        agree with the model."""
        from chassis.core.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = Llama4VisionSpec.from_config(hf_config)
        tiles = Llama4Tiles.from_dict(json.loads(path.read_text()), spec.image_size)
        settings = dict(_DEFAULTS)
        saved = saved_processor_config(model_dir)
        settings.update({k: saved[k] for k in _DEFAULTS if saved.get(k) is not None})
        downsample = round(1.0 / float(settings["pixel_shuffle_ratio"]) ** 2)
        per_tile = (spec.image_size // int(settings["patch_size"])) ** 2 // downsample
        if per_tile != spec.tokens_per_tile:
            raise ValueError(
                f"the processor writes {per_tile} image tokens per tile ((size // patch_size)"
                "**2 // round(1 / pixel_shuffle_ratio**2)), but the model gives "
                f"{spec.tokens_per_tile} rows per tile"
            )
        fake = str(settings["fake_image_token"])
        names = [*_RUN_TOKENS, *([fake] if fake not in _RUN_TOKENS else [])]
        found = image_token_ids(load_tokenizer(model_dir), names, PATCH, image_token_id)
        return cls(tiles, per_tile, dict(zip(names, found, strict=True)), fake)

    def prompt_placeholder(self, modality: str) -> str:
        return self.image_text

    def placeholder_ids(self, rows: int, cols: int) -> list[int]:
        """The token run of an image of ``rows x cols`` tiles (module docstring)."""
        ids = self.ids
        patches = [ids[PATCH]] * self.tokens_per_tile
        run = [ids[START]]
        if rows * cols > 1:
            for _ in range(rows):
                for col in range(cols):
                    run += patches
                    if col < cols - 1:
                        run.append(ids[TILE_X])
                run.append(ids[TILE_Y])
        return [*run, ids[IMAGE], *patches, ids[END]]

    def num_tokens(self, height: int, width: int) -> int:
        """Prompt tokens of an image of ``height x width`` pixels once expanded."""
        return len(self.placeholder_ids(*self.tiles.grid(height, width)))

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.tiles)
        rows, cols = self.tiles.grid(item.height, item.width)
        run = self.placeholder_ids(rows, cols)
        return len(run), {
            "pixel_values": torch.from_numpy(pixels),
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }

    def precomputed_item(
        self, modality: str, item: PrecomputedItem
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Image embeddings: the rows of an image of ``aspect_ratios`` ``[1, 2]`` (rows,
        columns) tiles in the model's order (the grid's row-major, then the global tile when
        there are several), or without it one tile's, written as that image's run; its
        tensors the rows and the run's ids. ``ValueError`` for a grid of more than
        ``max_patches`` tiles or a row count that is not the grid's tiles' rows."""
        rows = item.tensors[EMBEDS_KEY]
        aspect = item.tensors.get(ASPECT_KEY)
        grid_rows, grid_cols = (1, 1) if aspect is None else (int(x) for x in aspect[0])
        if grid_rows * grid_cols > self.tiles.max_tiles:
            raise ValueError(
                f"Llama 4 image embeddings of {grid_rows}x{grid_cols} tiles: the checkpoint's "
                f"images have at most {self.tiles.max_tiles} (max_patches)"
            )
        tiles = tiles_per_image(grid_rows, grid_cols)
        if len(rows) != tiles * self.tokens_per_tile:
            grid = "no aspect_ratios: one tile"
            if aspect is not None:
                grid = f"{ASPECT_KEY} {grid_rows}x{grid_cols}"
            raise ValueError(
                f"Llama 4 image embeddings have {len(rows)} rows, but {grid} takes "
                f"{tiles * self.tokens_per_tile} ({tiles} tiles of {self.tokens_per_tile} "
                f"rows); send an image of several tiles as {{{EMBEDS_KEY!r}: rows, "
                f"{ASPECT_KEY!r}: [[rows, columns]]}}"
            )
        run = self.placeholder_ids(grid_rows, grid_cols)
        return len(run), {
            EMBEDS_KEY: rows,
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
