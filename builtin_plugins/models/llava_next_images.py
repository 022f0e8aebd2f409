"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``: llava-hf's llava-v1.6-*) with images:
LLaVA-1.5's model (:mod:`.llava_images`: the text config's decoder, a CLIP or SigLIP tower,
the projector) plus the "anyres" packing of an image's tiles.

The front-end (:mod:`.llava_next_processing`) gives each image as its base tile and the tiles
of its best grid pinpoint (``pixel_values`` ``[1 + tiles, 3, S, S]``) and its size
(``image_sizes`` ``[1, 2]``: height, width). Every tile goes through the tower and projector
(``(S / patch)^2`` rows each); the image's rows are then, as HF's ``pack_image_features``
packs them with ``image_newline``: the base tile's rows, then the tiles' rows laid out as one
feature grid, unpadded to the image's aspect ratio, each grid row followed by the learned
``image_newline`` (:mod:`.llava_next_tiles`). The count depends on the image's size and is
the front-end's (transformers' processor's). ``image_newline`` (or ``model.image_newline``)
is read from the checkpoint, whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llava_images import LlavaForConditionalGenerationWithImages
from chassis.builtin_plugins.models.llava_next_tiles import (
    DEFAULT_PINPOINTS,
    parse_pinpoints,
    tile_grid,
    unpadded_span,
)
from chassis.core.model_interface import ModelBuildContext

#: the checkpoint's names of the newline row (hub files and transformers 5's saved layout;
#: its in-memory one)
_NEWLINE_NAMES = ("image_newline", "model.image_newline")


class LlavaNextForConditionalGenerationWithImages(LlavaForConditionalGenerationWithImages):
    """``LlavaNextForConditionalGeneration`` checkpoints with images (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder (or, for a tower not built here, the text-only class).
    """

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        vision = self.vision_spec.vision_config
        self.tile = int(vision.image_size)
        #: feature rows per tile side
        self.side = self.tile // int(vision.patch_size)
        if self.vision_spec.tokens_per_image != self.side**2:
            raise ValueError(
                f"LLaVA-NeXT images need {self.side**2} feature rows per tile; this tower with "
                f"vision_feature_select_strategy {self.vision_spec.strategy!r} gives "
                f"{self.vision_spec.tokens_per_image} (a CLIP tower needs 'default', a SigLIP "
                "one 'full')"
            )
        pinpoints = getattr(hf_config, "image_grid_pinpoints", None) or DEFAULT_PINPOINTS
        self.pinpoints = parse_pinpoints(pinpoints, self.tile)
        self.image_newline = nn.Parameter(torch.empty(int(hf_config.hidden_size)))

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor
        (:class:`~.llava_next_processing.LlavaNextImageInputs`)."""
        from chassis.builtin_plugins.models.llava_next_processing import LlavaNextImageInputs

        return LlavaNextImageInputs.from_pretrained(model_dir, hf_config)

    # -- inputs ---------------------------------------------------------------------------------

    def item_rows(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows: ``inputs["pixel_values"]`` ``[1 + tiles, C, S, S]`` and
        ``inputs["image_sizes"]`` ``[1, 2]`` -> ``[tokens, hidden_size]`` in the model's
        dtype. ``ValueError`` for another modality, a missing input, or shapes that do not
        agree with the image's size."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r} inputs")
        pixels, sizes = inputs.get("pixel_values"), inputs.get("image_sizes")
        if pixels is None or sizes is None:
            raise ValueError(
                f"image inputs need pixel_values and image_sizes (got {sorted(inputs)})"
            )
        if pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if sizes.numel() != 2 or pixels.dim() != 4:
            raise ValueError(
                "a feature holds one image: pixel_values [tiles, channels, height, width] and "
                f"image_sizes [1, 2]; got {tuple(pixels.shape)} and {tuple(sizes.shape)}"
            )
        height, width = (int(v) for v in sizes.reshape(2).tolist())
        return self.pack(self.image_features(pixels), height, width)

    def pack(self, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """An image's projected tiles ``[1 + tiles, side * side, hidden]`` (base first) ->
        its rows ``[tokens, hidden]``: the base tile's, then the unpadded grid with
        ``image_newline`` after each row."""
        if height < 1 or width < 1:
            raise ValueError(f"image_sizes {[height, width]} is not a size")
        grid_rows, grid_cols = tile_grid(height, width, self.pinpoints, self.tile)
        if features.shape[0] != 1 + grid_rows * grid_cols:
            raise ValueError(
                f"a {width}x{height} image has {1 + grid_rows * grid_cols} tiles (the base "
                f"and {grid_rows}x{grid_cols}); pixel_values has {features.shape[0]}"
            )
        side, dim = self.side, features.shape[-1]
        # [rows, cols, side, side, dim] -> one grid [rows * side, cols * side, dim]
        grid = features[1:].reshape(grid_rows, grid_cols, side, side, dim)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(grid_rows * side, grid_cols * side, dim)
        top, bottom, left, right = unpadded_span(height, width, grid.shape[0], grid.shape[1])
        grid = grid[top:bottom, left:right]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, dim)
        rows = torch.cat([grid, newline], dim=1).reshape(-1, dim)
        return torch.cat([features[0], rows])

    # -- weights --------------------------------------------------------------------------------

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """``image_newline`` besides what LLaVA-1.5 reads."""
        return name in _NEWLINE_NAMES or super().needs_checkpoint_tensor(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``image_newline`` into its parameter; the rest as LLaVA-1.5's."""
        filled: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name not in _NEWLINE_NAMES:
                    yield name, tensor
                    continue
                if tensor.shape != self.image_newline.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(self.image_newline.shape)} (does config.json match the weights?)"
                    )
                self.image_newline.copy_(tensor)
                filled.add("image_newline")

        return super().load_weights(others()) | filled
