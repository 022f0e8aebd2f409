"""Aya Vision images -> the model's inputs, as transformers' ``AyaVisionProcessor`` over its
``GotOcr2ImageProcessor`` (the PIL backend).

Tiles are InternVL's (:class:`~.internvl_processing.TilePreprocessing`: the grid's tiles,
then a thumbnail when there are several; ``AyaVisionProcessor`` always asks for
``crop_to_patches``). Prompt: one ``<|IMG_PATCH|>`` (the config's ``image_token_id``) stands
for an image (vLLM's convention of one placeholder token per item needs one token), or HF's
text ``<image>`` (the processor config's ``image_token``, which ``AyaVisionProcessor``
expands and a chat template written for it puts for an image part), which is no single token and
whose characters BPE merges with its neighbours' (`` <``, ``>.``): a prompt holding it is
decoded, cut at each ``<image>`` and its pieces encoded apart around one ``<|IMG_PATCH|>``
each, as HF's expanded run of special tokens cuts the text (refused when the prompt's tokens
are not the tokenizer's own encoding of their text). An image of ``n`` tiles expands, as
``AyaVisionProcessor.replace_image_token`` writes it, to ``<|START_OF_IMG|>``, then for each
of the first ``n - 1`` tiles the text ``TILE_i`` (``i`` from 1, tokenized as text) and
``tokens_per_tile`` ``<|IMG_PATCH|>``, then ``TILE_GLOBAL`` and ``tokens_per_tile``
``<|IMG_PATCH|>`` (the last tile: the thumbnail, or the only tile), then ``<|END_OF_IMG|>``.
The image's feature covers that whole run (offset at ``<|START_OF_IMG|>``) and carries its
token ids (``placeholder_ids``): the model returns one row per token of it.
``tokens_per_tile`` is ``(img_size // (patch_size * downsample_factor))**2`` from
``processor_config.json`` (transformers' defaults 364, 28, 1 without it) and must be the
model's rows per tile. The token texts are the processor config's. No per-request processor
kwargs are taken. Image embeddings (``--enable-mm-embeds``) of ``n * tokens_per_tile`` rows
are an image of ``n`` tiles: its run is written from ``n`` and the model splices the rows in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.aya_vision_projector import AyaVisionSpec
from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.internvl_processing import TilePreprocessing
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)
from chassis.builtin_plugins.models.run_writing_processor import RunWritingProcessor
from chassis.core.multimodal import MultiModalFeature
from chassis.core.multimodal_embeds import EMBEDS_KEY, PrecomputedItem
from chassis.core.multimodal_processing import MultiModalProcessor

#: ``AyaVisionProcessor``'s defaults for what ``processor_config.json`` leaves out
_DEFAULTS: dict[str, Any] = {
    "img_size": 364,
    "patch_size": 28,
    "downsample_factor": 1,
    "start_of_img_token": "<|START_OF_IMG|>",
    "end_of_img_token": "<|END_OF_IMG|>",
    "img_patch_token": "<|IMG_PATCH|>",
    "tile_token": "TILE",
    "tile_global_token": "TILE_GLOBAL",
    "image_token": "<image>",
}


class AyaVisionImageInputs(RunWritingProcessor, MultiModalProcessor):
    """Images of Aya Vision requests (the module docstring). ``start_id``, ``end_id`` and
    ``patch_id`` are the ids of ``<|START_OF_IMG|>``, ``<|END_OF_IMG|>`` and
    ``<|IMG_PATCH|>``; ``tile_labels[i]`` the token ids of the ``i``-th tile's label
    (``i`` from 1 to ``max_tiles``; index 0: ``TILE_GLOBAL``'s)."""

    def __init__(
        self,
        tiles: TilePreprocessing,
        tokens_per_tile: int,
        start_id: int,
        end_id: int,
        patch_id: int,
        tile_labels: Sequence[Sequence[int]],
        patch_token: str = _DEFAULTS["img_patch_token"],
        tokenizer: Any = None,
        image_text: str = _DEFAULTS["image_token"],
    ) -> None:
        self.tiles = tiles
        #: the checkpoint's tokenizer, to read HF's ``image_text`` in prompts (``None``: not
        #: read, only ``<|IMG_PATCH|>`` stands for an image)
        self.tokenizer = tokenizer
        self.image_text = image_text
        self.tokens_per_tile = tokens_per_tile
        self.start_id, self.end_id, self.patch_id = start_id, end_id, patch_id
        self.tile_labels = [list(ids) for ids in tile_labels]
        self.patch_token = patch_token
        self.placeholder_token_ids = {"image": patch_id}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> AyaVisionImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its
        ``preprocessor_config.json``, ``processor_config.json`` and tokenizer) for the model
        of ``hf_config``; ``ValueError`` when something is missing, not supported, or does not
        agree with the model."""
        from chassis.core.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = AyaVisionSpec.from_config(hf_config)
        side = int(spec.vision_config.image_size)
        tiles = TilePreprocessing.from_dict(json.loads(path.read_text()), side)
        settings = dict(_DEFAULTS)
        saved = saved_processor_config(model_dir)
        settings.update({k: saved[k] for k in _DEFAULTS if saved.get(k) is not None})
        unit = int(settings["patch_size"]) * int(settings["downsample_factor"])
        per_tile = (int(settings["img_size"]) // unit) ** 2
        if per_tile != spec.tokens_per_tile:
            raise ValueError(
                f"the processor writes {per_tile} image tokens per tile ((img_size // "
                "(patch_size * downsample_factor))**2), but the model gives "
                f"{spec.tokens_per_tile} rows per tile"
            )
        tokenizer = load_tokenizer(model_dir)
        names = [
            str(settings[key])
            for key in ("start_of_img_token", "end_of_img_token", "img_patch_token")
        ]
        ids = image_token_ids(tokenizer, names, names[2], image_token_id)
        labels = [str(settings["tile_global_token"])] + [
            f"{settings['tile_token']}_{i}" for i in range(1, tiles.max_tiles + 1)
        ]
        tile_labels = [tokenizer.encode(label, add_special_tokens=False) for label in labels]
        return cls(
            tiles,
            per_tile,
            ids[0],
            ids[1],
            ids[2],
            tile_labels,
            str(settings["img_patch_token"]),
            tokenizer,
            str(settings["image_token"]),
        )

    def prompt_placeholder(self, modality: str) -> str:
        return self.patch_token

    def placeholder_ids(self, num_tiles: int) -> list[int]:
        """The token run of an image of ``num_tiles`` tiles (module docstring)."""
        patches = [self.patch_id] * self.tokens_per_tile
        run = [self.start_id]
        for i in range(1, num_tiles):
            run += self.tile_labels[i] + patches
        return run + self.tile_labels[0] + patches + [self.end_id]

    def num_tokens(self, height: int, width: int) -> int:
        """Prompt tokens of an image of ``height x width`` pixels once expanded."""
        return len(self.placeholder_ids(self.tiles.num_tiles(height, width)))

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.tiles)
        run = self.placeholder_ids(pixels.shape[0])
        return len(run), {
            "pixel_values": torch.from_numpy(pixels),
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }

    def precomputed_item(
        self, modality: str, item: PrecomputedItem
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Image embeddings ``[tiles * tokens_per_tile, hidden]``: the rows of ``tiles``
        tiles in the model's order (the grid's, then the thumbnail; one tile alone when the
        image was not split), written as the run of an image of that many tiles; its
        tensors the rows and the run's ids. ``ValueError`` for a row count that is not
        1 to ``max_tiles + 1`` tiles' rows."""
        rows = item.tensors[EMBEDS_KEY]
        tiles, rest = divmod(len(rows), self.tokens_per_tile)
        if rest or not 1 <= tiles <= len(self.tile_labels):
            raise ValueError(
                f"Aya Vision image embeddings have {len(rows)} rows; an image's rows are its "
                f"tiles' ({self.tokens_per_tile} rows a tile, 1 to {len(self.tile_labels)} "
                "tiles: the grid's, then the thumbnail)"
            )
        run = self.placeholder_ids(tiles)
        return len(run), {
            EMBEDS_KEY: rows,
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """As :meth:`MultiModalProcessor.process` once HF's ``<image>`` texts are tokens
        (:meth:`image_tokens`), then each image's run rewritten to its tokens (module
        docstring)."""
        return super().process(self.image_tokens(prompt_token_ids), items, kwargs)

    def image_tokens(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt with each HF ``<image>`` text written as one ``<|IMG_PATCH|>`` token
        (module docstring); the prompt as it is when its text holds none. ``ValueError``
        when it does but its tokens are not the tokenizer's encoding of that text."""
        ids = list(prompt_token_ids)
        tokenizer = self.tokenizer
        if tokenizer is None:
            return ids
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.image_text not in text:
            return ids
        if tokenizer.encode(text, add_special_tokens=False) != ids:
            raise ValueError(
                f"the prompt writes images as {self.image_text!r}, but its token ids are not "
                f"the tokenizer's encoding of its text: write {self.patch_token!r} for each "
                "image instead"
            )
        first, *rest = text.split(self.image_text)
        out = tokenizer.encode(first, add_special_tokens=False)
        for piece in rest:
            out += [self.patch_id, *tokenizer.encode(piece, add_special_tokens=False)]
        return out
