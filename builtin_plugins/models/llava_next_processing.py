"""LLaVA-NeXT images -> the model's inputs, as transformers' ``LlavaNextProcessor`` over its
``LlavaNextImageProcessor`` (the PIL backend), in PIL and numpy.

For each image, after RGB (transparency over white), HF's "anyres" steps (the geometry is
:mod:`.llava_next_tiles`'):

1. the best grid pinpoint for the image's size; the image resized to fit it (PIL, the
   config's ``resample``: bicubic), centred on a black canvas of the pinpoint's size (the odd
   pixel of padding after the image) and cut into tiles of ``crop_size`` (the tower's
   ``image_size`` ``S``), row-major;
2. the base tile: the whole image resized to ``size`` (``shortest_edge`` as a square, or
   ``height`` x ``width``);
3. every tile, base first, through the LLaVA-1.5 steps (:class:`~.llava_processing.
   ClipPreprocessing`: resize, centre crop, rescale, normalize), which leave ``S x S`` tiles
   as they are.

An image's inputs are ``pixel_values`` ``[1 + tiles, 3, S, S]`` float32 and ``image_sizes``
``[1, 2]`` (its height and width); it stands for as many ``<image>`` tokens as the model
packs rows for it (:func:`~.llava_next_tiles.num_image_tokens`: transformers' count). The
processor config's ``do_pad`` (padding the tile counts of a batch to one size) does nothing
here: each image travels alone. No per-request processor kwargs are taken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_next_tiles import (
    DEFAULT_PINPOINTS,
    best_resolution,
    fitted_size,
    num_image_tokens,
    parse_pinpoints,
)
from chassis.builtin_plugins.models.llava_processing import IMAGE_PLACEHOLDER, ClipPreprocessing
from chassis.builtin_plugins.models.llava_vision import LlavaVisionSpec
from chassis.builtin_plugins.models.processor_files import image_processor_source
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_processing import MultiModalProcessor

_PROCESSOR_TYPES = ("LlavaNextImageProcessor", "LlavaNextImageProcessorFast")


class AnyresPreprocessing:
    """The steps above for one checkpoint: ``pinpoints`` and ``tile`` (the tiles' side), the
    base tile's ``base_size`` (height, width) and the per-tile ``steps``."""

    def __init__(
        self,
        steps: ClipPreprocessing,
        pinpoints: tuple[tuple[int, int], ...],
        tile: int,
        base_size: tuple[int, int],
    ) -> None:
        self.steps = steps
        self.pinpoints = pinpoints
        self.tile = tile
        self.base_size = base_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], side: int) -> AnyresPreprocessing:
        """The steps of a ``LlavaNextImageProcessor`` config for a tower of ``side`` pixels;
        ``ValueError`` for another processor type, a setting not followed, or one whose tiles
        would not be the tower's square."""
        kind = str(config.get("image_processor_type") or _PROCESSOR_TYPES[0])
        if kind.removesuffix("Pil") not in _PROCESSOR_TYPES:
            raise ValueError(
                f"image processor {kind!r} is not supported for LLaVA-NeXT images; supported: "
                "LlavaNextImageProcessor"
            )
        # the per-tile steps are CLIP's, with LLaVA-NeXT's defaults; its do_pad pads batches
        steps = ClipPreprocessing.from_dict(
            {**config, "image_processor_type": "CLIPImageProcessor", "do_pad": False}
        )
        size = config.get("size") or {"shortest_edge": 224}
        crop = config.get("crop_size") or {"height": 224, "width": 224}
        base_size = _base_size(size)
        if isinstance(crop, Mapping) and "height" in crop:
            tile = int(crop["height"])
        elif isinstance(crop, int) and not isinstance(crop, bool):
            tile = crop
        else:
            tile = base_size[0]
        if tile != side:
            raise ValueError(
                f"the image processor cuts {tile}-pixel tiles, but the vision tower takes "
                f"{side}x{side} (image_size)"
            )
        pinpoints = parse_pinpoints(config.get("image_grid_pinpoints") or DEFAULT_PINPOINTS, tile)
        for what, (height, width) in (("tiles", (tile, tile)), ("base tiles", base_size)):
            if steps.output_size(height, width) != (side, side):
                made = "x".join(map(str, steps.output_size(height, width)))
                raise ValueError(
                    f"the image processor makes {made} {what}, but the vision tower takes "
                    f"{side}x{side} (image_size): its size / crop settings are not supported"
                )
        return cls(steps, pinpoints, tile, base_size)

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[1 + tiles, 3, S, S]`` float32 pixels, the base tile first."""
        from PIL import Image

        image = to_rgb(image)
        target = best_resolution(image.height, image.width, self.pinpoints)
        height, width = fitted_size(image.height, image.width, target)
        canvas = Image.new("RGB", (target[1], target[0]), (0, 0, 0))
        fitted = image.resize((width, height), resample=self.steps.resample)
        canvas.paste(fitted, ((target[1] - width) // 2, (target[0] - height) // 2))
        base_height, base_width = self.base_size
        tiles = [image.resize((base_width, base_height), resample=self.steps.resample)]
        tiles += [
            canvas.crop((left, top, left + self.tile, top + self.tile))
            for top in range(0, target[0], self.tile)
            for left in range(0, target[1], self.tile)
        ]
        return np.stack([self.steps(tile) for tile in tiles])


class LlavaNextImageInputs(MultiModalProcessor):
    """Images of LLaVA-NeXT requests (the module docstring): an image's token count depends
    on its size."""

    def __init__(
        self, preprocessing: AnyresPreprocessing, image_token_id: int, spec: LlavaVisionSpec
    ) -> None:
        self.anyres = preprocessing
        self.spec = spec
        self.placeholder_token_ids = {"image": int(image_token_id)}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> LlavaNextImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its ``preprocessor_config.json``)
        for the model of ``hf_config``; ``ValueError`` when the folder has no image processor
        config, its settings are not supported, or its ``image_grid_pinpoints`` differ from
        the model config's (the model would pack other grids than the tiles made)."""
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = LlavaVisionSpec.from_config(hf_config)
        side = int(spec.vision_config.image_size)
        preprocessing = AnyresPreprocessing.from_dict(json.loads(path.read_text()), side)
        model_pinpoints = parse_pinpoints(
            getattr(hf_config, "image_grid_pinpoints", None) or DEFAULT_PINPOINTS, side
        )
        if model_pinpoints != preprocessing.pinpoints:
            raise ValueError(
                f"{path} has image_grid_pinpoints {[list(p) for p in preprocessing.pinpoints]}, "
                f"but the model's config has {[list(p) for p in model_pinpoints]}"
            )
        return cls(preprocessing, image_token_id, spec)

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of ``height x width`` pixels."""
        side = int(self.spec.vision_config.image_size) // int(self.spec.vision_config.patch_size)
        return num_image_tokens(
            height, width, self.anyres.pinpoints, self.anyres.tile, side, self.spec.tokens_per_image
        )

    def prompt_placeholder(self, modality: str) -> str:
        return IMAGE_PLACEHOLDER

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.anyres)
        tensors = {
            "pixel_values": torch.from_numpy(pixels),
            "image_sizes": torch.tensor([[item.height, item.width]], dtype=torch.int64),
        }
        return self.num_tokens(item.height, item.width), tensors


def _base_size(size: Any) -> tuple[int, int]:
    """The base tile's (height, width) from a config's ``size``: a ``shortest_edge`` (or an
    int) as a square, or ``height`` and ``width``."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, Mapping):
        if "height" in size and "width" in size:
            return int(size["height"]), int(size["width"])
        if "shortest_edge" in size:
            return int(size["shortest_edge"]), int(size["shortest_edge"])
    raise ValueError(f"size {size!r} is not supported (shortest_edge, or height and width)")
