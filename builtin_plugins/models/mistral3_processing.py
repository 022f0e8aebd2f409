"""Mistral 3 images -> the model's inputs, as transformers' ``PixtralProcessor`` over
``PixtralImageProcessor`` (its PIL backend), in PIL and numpy.

Pixels (the checkpoint's ``preprocessor_config.json``), HF's steps in HF's order:

1. RGB (transparency over white);
2. resize: an image larger than ``size.longest_edge`` (or ``size.height`` x ``size.width``)
   is scaled down by ``ratio = max(height / max_h, width / max_w)``, each side
   ``floor(side / ratio)``; then each side is rounded *up* to a multiple of ``P * m`` (the
   tower's patch size times ``spatial_merge_size``: one image token's square), and the image
   is resized to exactly that (stretched, not padded) with PIL's ``resample`` filter
   (bicubic) on the 8-bit image;
3. ``do_rescale`` (``* rescale_factor`` in float64, kept as float32) and ``do_normalize``
   (``(x - mean) / std`` in float32).

``pixel_values`` is ``[1, 3, H, W]`` float32, one image (no batch padding).

Prompt: one ``[IMG]`` per image (vLLM's convention; Mistral 3's chat template writes
``[IMG]``). An image of ``rows x cols`` tokens (``H / (P*m)`` by ``W / (P*m)``) expands, as
``PixtralProcessor`` does, to ``cols`` ``[IMG]`` tokens then ``[IMG_BREAK]`` per row, the last
row's ``[IMG_BREAK]`` being ``[IMG_END]``: ``rows * (cols + 1)`` tokens. The break and end
tokens are ordinary text tokens in the prompt; the image's feature covers the whole run
(offset at its first ``[IMG]``, length ``rows * (cols + 1)``) and carries the run's token
ids (``placeholder_ids``), so the model's ``embed_multimodal`` returns one row per token of
the run: the image's rows at the ``[IMG]`` tokens, the token embeddings of the break and end
tokens elsewhere (what HF's model computes there). No per-request processor kwargs are
taken.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_processing import rgb_channels
from chassis.builtin_plugins.models.mistral3_vision import Mistral3VisionSpec
from chassis.builtin_plugins.models.processor_files import (
    image_processor_source,
    image_token_ids,
    saved_processor_config,
)
from chassis.builtin_plugins.models.run_writing_processor import RunWritingProcessor
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_processing import MultiModalProcessor

#: transformers' defaults of ``PixtralImageProcessor`` for what its config leaves out
_DEFAULTS: dict[str, Any] = {
    "size": {"longest_edge": 1024},
    "resample": 3,  # bicubic
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
}
#: the special tokens of ``PixtralProcessor`` (``processor_config.json`` may rename them)
_TOKEN_DEFAULTS = {
    "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
}


@dataclass(frozen=True)
class PixtralPreprocessing:
    """The steps of a ``PixtralImageProcessor`` config (module docstring), checked;
    ``unit`` is one image token's side in pixels (``P * m``)."""

    max_size: tuple[int, int]
    unit: int
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], unit: int) -> PixtralPreprocessing:
        """The steps of an image processor config; ``ValueError`` for a processor type or a
        setting not handled here."""
        kind = str(config.get("image_processor_type") or "PixtralImageProcessor")
        kind = kind.removesuffix("Fast").removesuffix("Pil")
        if kind != "PixtralImageProcessor":
            raise ValueError(
                f"image processor {kind!r} is not supported for Mistral 3 images "
                "(PixtralImageProcessor)"
            )
        settings = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if not settings["do_resize"]:
            raise ValueError("do_resize false is not supported (images must fit the tokens' grid)")
        if settings.get("do_center_crop"):
            raise ValueError("do_center_crop is not supported for Mistral 3 images")
        size = settings["size"]
        if isinstance(size, Mapping) and size.get("longest_edge"):
            max_size = (int(size["longest_edge"]), int(size["longest_edge"]))
        elif isinstance(size, Mapping) and size.get("height") and size.get("width"):
            max_size = (int(size["height"]), int(size["width"]))
        else:
            raise ValueError(f"size {size!r} is not supported (longest_edge, or height and width)")
        normalize = bool(settings["do_normalize"])
        return cls(
            max_size=max_size,
            unit=unit,
            resample=int(settings["resample"]),
            rescale_factor=float(settings["rescale_factor"]) if settings["do_rescale"] else None,
            mean=rgb_channels(settings["image_mean"], "image_mean") if normalize else None,
            std=rgb_channels(settings["image_std"], "image_std") if normalize else None,
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels of what an image of that size becomes (multiples of
        :attr:`unit`); ``ValueError`` when a side would shrink to nothing."""
        max_h, max_w = self.max_size
        ratio = max(height / max_h, width / max_w)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        if height < 1 or width < 1:
            raise ValueError(
                f"the image's aspect ratio is too extreme: it would be scaled to "
                f"{width}x{height} pixels to fit {max_w}x{max_h}"
            )
        unit = self.unit
        return -(-height // unit) * unit, -(-width // unit) * unit

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[3, H, W]`` float32 pixels."""
        image = to_rgb(image)
        height, width = self.output_size(image.height, image.width)
        image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
        out = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)


class Mistral3ImageInputs(RunWritingProcessor, MultiModalProcessor):
    """Images of Mistral 3 requests (module docstring). ``token_ids`` are the ids of
    ``[IMG]``, ``[IMG_BREAK]`` and ``[IMG_END]``; ``image_token`` is ``[IMG]``'s text."""

    def __init__(
        self,
        preprocessing: PixtralPreprocessing,
        token_ids: tuple[int, int, int],
        image_token: str = _TOKEN_DEFAULTS["image_token"],
    ) -> None:
        self.preprocessing = preprocessing
        self.image_token = image_token
        self.image_token_id, self.break_token_id, self.end_token_id = token_ids
        self.placeholder_token_ids = {"image": self.image_token_id}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Mistral3ImageInputs:
        """The processor of the checkpoint in ``model_dir``: its
        ``preprocessor_config.json``, the token texts of its ``processor_config.json``
        (``PixtralProcessor``'s defaults without one) and their ids in its tokenizer, for the
        model of ``hf_config`` (``image_token_id``, patch and merge sizes); ``ValueError``
        when something is missing or not supported."""
        from chassis.core.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = Mistral3VisionSpec.from_config(hf_config)
        preprocessing = PixtralPreprocessing.from_dict(
            json.loads(path.read_text()), spec.pixels_per_token
        )
        names = dict(_TOKEN_DEFAULTS)
        saved = saved_processor_config(model_dir)
        names.update({k: saved[k] for k in names if isinstance(saved.get(k), str)})
        tokenizer = load_tokenizer(model_dir)
        keys = ("image_token", "image_break_token", "image_end_token")
        ids = image_token_ids(
            tokenizer, [names[k] for k in keys], names["image_token"], image_token_id
        )
        return cls(preprocessing, (ids[0], ids[1], ids[2]), names["image_token"])

    def prompt_placeholder(self, modality: str) -> str:
        return self.image_token

    def placeholder_ids(self, rows: int, cols: int) -> list[int]:
        """The token run of an image of ``rows x cols`` tokens (module docstring)."""
        run = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        run[-1] = self.end_token_id
        return run

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.preprocessing)
        unit = self.preprocessing.unit
        run = self.placeholder_ids(pixels.shape[1] // unit, pixels.shape[2] // unit)
        return len(run), {
            "pixel_values": torch.from_numpy(pixels)[None],
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
