"""InternVL images -> the model's inputs, as transformers' ``InternVLProcessor`` over its
``GotOcr2ImageProcessor`` (the PIL backend), in PIL and numpy.

Tiles (``preprocessor_config.json``; ``InternVLProcessor`` always asks for
``crop_to_patches``, whatever the image processor's config says):

1. RGB (transparency over white);
2. the grid: of the ``cols x rows`` grids with ``min_patches <= cols * rows <=
   max_patches`` (in order of tile count, then as transformers enumerates them), the one whose
   ``cols / rows`` is closest to the image's ``width / height``; on a tie, the later grid
   wins while the image's area exceeds half the grid's pixel area (:func:`best_grid`);
3. the image resized (PIL, the config's ``resample``: bicubic) to ``cols * S`` x ``rows * S``
   (``S`` = ``size``, the tower's ``image_size``) and cut into ``S x S`` tiles, row-major;
   with more than one tile, a thumbnail (the whole image resized to ``S x S``) after them.
   With ``max_patches`` 1, the image resized to ``S x S`` is the one tile;
4. each tile ``* rescale_factor`` (float64, kept as float32) and ``(x - mean) / std``.

An image's inputs are ``pixel_values`` ``[tiles, 3, S, S]`` float32. Prompt: the chat
template writes ``<IMG_CONTEXT>`` (the tokenizer's ``context_image_token``, the config's
``image_token_id``) where an image goes; each becomes, as ``InternVLProcessor`` expands it,
``<img>``, ``tiles * image_seq_length`` ``<IMG_CONTEXT>`` tokens (the image's placeholder
tokens: the feature's range) and ``</img>``. ``image_seq_length`` (``processor_config.json``,
256 by default) must be the tower's rows per tile. No per-request processor kwargs are taken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.internvl_vision import InternVLVisionSpec
from chassis.builtin_plugins.models.llava_processing import (
    CLIP_MEAN,
    CLIP_STD,
    ClipPreprocessing,
    rgb_channels,
)
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal import MultiModalFeature
from chassis.core.multimodal_processing import MultiModalProcessor

_PROCESSOR_TYPE = "GotOcr2ImageProcessor"
_BICUBIC = 3
#: the tokenizer's names of InternVL's image tokens, and transformers' texts for them
_TOKEN_DEFAULTS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
}
#: the processor's default ``image_seq_length`` (rows per tile)
_DEFAULT_SEQ_LENGTH = 256


def grid_choices(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """The ``(cols, rows)`` grids of ``min_tiles`` to ``max_tiles`` tiles, by tile count
    (ties in enumeration order: cols, then rows)."""
    grids = [
        (cols, rows)
        for cols in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if min_tiles <= cols * rows <= max_tiles
    ]
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


def best_grid(
    height: int, width: int, tile: int, min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """``(cols, rows)`` of the grid an image of ``height x width`` is cut into (module
    docstring, step 2); ``(1, 1)`` when no grid qualifies."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grid_choices(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


class TilePreprocessing:
    """Steps 1-4 of the module docstring for one checkpoint: tiles of ``tile`` pixels,
    ``min_tiles`` to ``max_tiles`` of them (``max_tiles`` 1: no grid), the PIL ``resample``
    filter, and the per-tile rescale / normalize ``steps``."""

    def __init__(
        self,
        tile: int,
        min_tiles: int,
        max_tiles: int,
        resample: int,
        steps: ClipPreprocessing,
    ) -> None:
        self.tile = tile
        self.min_tiles = min_tiles
        self.max_tiles = max_tiles
        self.resample = resample
        self.steps = steps

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], side: int) -> TilePreprocessing:
        """The steps of a ``GotOcr2ImageProcessor`` config for a tower of ``side`` pixels;
        ``ValueError`` for another processor type or a setting not followed."""
        kind = str(config.get("image_processor_type") or _PROCESSOR_TYPE)
        if kind.removesuffix("Fast").removesuffix("Pil") != _PROCESSOR_TYPE:
            raise ValueError(
                f"image processor {kind!r} is not supported for InternVL images; supported: "
                f"{_PROCESSOR_TYPE}"
            )
        settings = {k: v for k, v in config.items() if v is not None}

        def flag(name: str) -> bool:
            return bool(settings.get(name, True))

        size = settings.get("size", {"height": 384, "width": 384})
        if isinstance(size, int) and not isinstance(size, bool):
            size = {"height": size, "width": size}
        if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
            raise ValueError(f"size {size!r} is not supported (height and width)")
        if (int(size["height"]), int(size["width"])) != (side, side) or not flag("do_resize"):
            made = "unresized images" if not flag("do_resize") else f"{size} tiles"
            raise ValueError(
                f"the image processor makes {made}, but the vision tower takes {side}x{side} "
                "(image_size)"
            )
        min_tiles = int(settings.get("min_patches", 1))
        max_tiles = int(settings.get("max_patches", 12))
        if not 1 <= min_tiles <= max_tiles:
            raise ValueError(
                f"min_patches {min_tiles} and max_patches {max_tiles} allow no grid of tiles"
            )
        mean = rgb_channels(settings.get("image_mean", CLIP_MEAN), "image_mean")
        std = rgb_channels(settings.get("image_std", CLIP_STD), "image_std")
        steps = ClipPreprocessing(
            do_pad=False,
            pad_color=(0, 0, 0),
            resize=None,
            resample=int(settings.get("resample", _BICUBIC)),
            crop=None,
            rescale_factor=float(settings.get("rescale_factor", 1 / 255))
            if flag("do_rescale")
            else None,
            mean=mean if flag("do_normalize") else None,
            std=std if flag("do_normalize") else None,
        )
        return cls(side, min_tiles, max_tiles, steps.resample, steps)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(cols, rows)`` of an image's grid; ``(1, 1)`` without tiling."""
        if self.max_tiles <= 1:
            return 1, 1
        return best_grid(height, width, self.tile, self.min_tiles, self.max_tiles)

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles of an image of ``height x width``: the grid's, and the thumbnail if more
        than one."""
        cols, rows = self.grid(height, width)
        return 1 if cols * rows == 1 else cols * rows + 1

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[tiles, 3, S, S]`` float32 pixels."""
        image = to_rgb(image)
        cols, rows = self.grid(image.height, image.width)
        side = self.tile
        resized = image.resize((cols * side, rows * side), resample=self.resample)
        tiles = [
            resized.crop((col * side, row * side, (col + 1) * side, (row + 1) * side))
            for row in range(rows)
            for col in range(cols)
        ]
        if len(tiles) > 1:
            tiles.append(image.resize((side, side), resample=self.resample))
        return np.stack([self.steps(tile) for tile in tiles])


class InternVLImageInputs(MultiModalProcessor):
    """Images of InternVL requests (the module docstring). ``token_ids`` are the ids of
    ``<img>``, ``</img>`` and ``<IMG_CONTEXT>``; ``context_token`` is the last one's text."""

    def __init__(
        self,
        tiles: TilePreprocessing,
        tokens_per_tile: int,
        token_ids: tuple[int, int, int],
        context_token: str = _TOKEN_DEFAULTS["context_image_token"],
    ) -> None:
        self.tiles = tiles
        self.tokens_per_tile = tokens_per_tile
        self.start_token_id, self.end_token_id, self.image_token_id = token_ids
        self.context_token = context_token
        self.placeholder_token_ids = {"image": self.image_token_id}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> InternVLImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its
        ``preprocessor_config.json``, ``processor_config.json``'s ``image_seq_length``, its
        tokenizer's image tokens) for the model of ``hf_config``; ``ValueError`` when
        something is missing, not supported, or does not agree with the model."""
        from chassis.core.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = InternVLVisionSpec.from_config(hf_config)
        tiles = TilePreprocessing.from_dict(json.loads(path.read_text()), spec.image_size)
        saved = saved_processor_config(model_dir).get("image_seq_length")
        seq_length = int(saved) if saved is not None else _DEFAULT_SEQ_LENGTH
        if seq_length != spec.tokens_per_tile:
            raise ValueError(
                f"the processor's image_seq_length is {seq_length}, but the model gives "
                f"{spec.tokens_per_tile} rows per tile (image_size / patch_size * "
                "downsample_ratio, squared)"
            )
        names = _token_names(model_dir)
        tokenizer = load_tokenizer(model_dir)
        keys = ("start_image_token", "end_image_token", "context_image_token")
        ids = image_token_ids(
            tokenizer, [names[k] for k in keys], names["context_image_token"], image_token_id
        )
        return cls(
            tiles, spec.tokens_per_tile, (ids[0], ids[1], ids[2]), names["context_image_token"]
        )

    def prompt_placeholder(self, modality: str) -> str:
        return self.context_token

    def num_tokens(self, height: int, width: int) -> int:
        """Prompt tokens of an image of ``height x width`` pixels once expanded, ``<img>``
        and ``</img>`` included (transformers' ``_get_num_multimodal_tokens`` before 5.25;
        from 5.25 that counts the ``<IMG_CONTEXT>`` run only, 2 fewer)."""
        return 2 + self.tiles.num_tiles(height, width) * self.tokens_per_tile

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.tiles)
        return pixels.shape[0] * self.tokens_per_tile, {"pixel_values": torch.from_numpy(pixels)}

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """As :meth:`MultiModalProcessor.process`, each image's run of ``<IMG_CONTEXT>``
        tokens framed by ``<img>`` and ``</img>`` (the features' ranges: the run)."""
        expanded, plain = super().process(prompt_token_ids, items, kwargs)
        framed: list[int] = []
        features: list[MultiModalFeature] = []
        start = 0
        for feature in plain:
            framed.extend(expanded[start : feature.offset])
            framed.append(self.start_token_id)
            features.append(msgspec.structs.replace(feature, offset=len(framed)))
            framed.extend(expanded[feature.offset : feature.end])
            framed.append(self.end_token_id)
            start = feature.end
        framed.extend(expanded[start:])
        return framed, features


def _token_names(model_dir: Path) -> dict[str, str]:
    """The texts of the image tokens: the tokenizer config's (as transformers 4 saved them,
    under ``extra_special_tokens``; as 5 does, at the top level and under
    ``model_specific_special_tokens``), else transformers' defaults."""
    names = dict(_TOKEN_DEFAULTS)
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    for where in (config.get("extra_special_tokens"), config.get("model_specific_special_tokens")):
        if isinstance(where, Mapping):
            names.update({k: where[k] for k in names if isinstance(where.get(k), str)})
    names.update({k: config[k] for k in names if isinstance(config.get(k), str)})
    return names
