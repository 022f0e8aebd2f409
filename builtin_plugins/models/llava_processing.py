"""LLaVA images -> the model's inputs, as transformers' ``LlavaProcessor`` over a CLIP,
LLaVA or SigLIP image processor (their PIL backends), in PIL and numpy.

The checkpoint's ``preprocessor_config.json`` says what to do; the steps, in HF's order:

1. RGB (transparency over white);
2. ``do_pad`` (``LlavaImageProcessor`` only): pad to a square, the image centred, the
   padding of colour ``int(mean * 255)`` per channel;
3. ``do_resize``: ``size.shortest_edge`` scales the shorter side to it (the longer one to
   ``int(edge * long / short)``), or ``size.height`` / ``size.width`` exactly; PIL's
   ``resample`` filter (bicubic in the released configs) on the 8-bit image;
4. ``do_center_crop`` to ``crop_size`` (offsets ``(side - crop) // 2``; zero padding where
   the image is smaller);
5. ``do_rescale`` (``* rescale_factor``, computed in float64, kept as float32) and
   ``do_normalize`` (``(x - mean) / std`` in float32).

The result must be the vision tower's ``image_size`` square (checked when the processor is
built, so a config that would make other sizes is refused then): ``pixel_values``
``[1, 3, S, S]`` float32. Each image stands for ``tokens_per_image`` placeholder tokens
(:class:`~.llava_vision.LlavaVisionSpec`): the prompt's one ``<image>`` per image is
expanded to that many (vLLM's prompt convention; LLaVA's chat templates write ``<image>``).
No per-request processor kwargs are taken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_vision import LlavaVisionSpec
from chassis.builtin_plugins.models.processor_files import image_processor_source
from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_processing import MultiModalProcessor

#: the text standing for one image in a LLaVA prompt
IMAGE_PLACEHOLDER = "<image>"

#: OpenAI CLIP's per-channel normalization (transformers' ``OPENAI_CLIP_MEAN`` / ``_STD``),
#: the default of the CLIP-style image and video processors here
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: the image processors handled (``image_processor_type`` without a ``Fast`` / ``Pil``
#: suffix) and their defaults for what the config leaves out (transformers')
_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
    },
}
_DEFAULTS["LlavaImageProcessor"] = {**_DEFAULTS["CLIPImageProcessor"], "do_pad": False}
_BICUBIC = 3
#: the most pixels an image is resized to (PIL's decompression-bomb limit); a shortest-edge
#: resize of a very thin image would otherwise allocate gigabytes before the crop
_MAX_RESIZED_PIXELS = 89_478_485


@dataclass(frozen=True)
class ClipPreprocessing:
    """The steps of a ``preprocessor_config.json`` (module docstring), checked."""

    do_pad: bool
    #: the padding's colour (``int(mean * 255)`` per channel, whether or not it normalizes)
    pad_color: tuple[int, int, int]
    #: ``("shortest_edge", edge)`` or ``("exact", (height, width))``; ``None``: no resize
    resize: tuple[str, Any] | None
    resample: int
    #: (height, width) of the centre crop; ``None``: no crop
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ClipPreprocessing:
        """The steps of an image processor config; ``ValueError`` for a processor type not
        handled here or a setting it cannot follow."""
        kind = str(config.get("image_processor_type") or "CLIPImageProcessor")
        kind = kind.removesuffix("Fast").removesuffix("Pil")
        if kind not in _DEFAULTS:
            raise ValueError(
                f"image processor {kind!r} is not supported for LLaVA images; supported: "
                f"{', '.join(_DEFAULTS)}"
            )
        settings = {**_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}

        def flag(name: str) -> bool:
            return bool(settings.get(name, name != "do_pad"))  # do_* default on, pad off

        if flag("do_pad") and kind != "LlavaImageProcessor":
            raise ValueError(f"do_pad is not supported for {kind}")
        resize = _resize_rule(settings["size"]) if flag("do_resize") else None
        crop = _square_or_pair(settings.get("crop_size"), "crop_size")
        mean, std = settings.get("image_mean"), settings.get("image_std")
        pad_mean = rgb_channels(mean, "image_mean") if mean is not None else (0.0, 0.0, 0.0)
        return cls(
            do_pad=flag("do_pad"),
            pad_color=(int(pad_mean[0] * 255), int(pad_mean[1] * 255), int(pad_mean[2] * 255)),
            resize=resize,
            resample=int(settings.get("resample", _BICUBIC)),
            crop=crop if flag("do_center_crop") else None,
            rescale_factor=float(settings.get("rescale_factor", 1 / 255))
            if flag("do_rescale")
            else None,
            mean=rgb_channels(mean, "image_mean") if flag("do_normalize") else None,
            std=rgb_channels(std, "image_std") if flag("do_normalize") else None,
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the pixels an image of that size becomes."""
        if self.do_pad:
            height = width = max(height, width)
        if self.resize is not None:
            height, width = _resized(height, width, self.resize)
        if self.crop is not None:
            height, width = self.crop
        return height, width

    def fixed_size(self) -> tuple[int, int] | None:
        """The output (height, width) when it is the same for every image, else ``None``."""
        sizes = {self.output_size(h, w) for h, w in ((100, 100), (100, 300), (300, 100))}
        return sizes.pop() if len(sizes) == 1 else None

    def __call__(self, image: Any) -> np.ndarray:
        """A PIL image -> ``[3, height, width]`` float32 pixels (RGB first)."""
        image = to_rgb(image)
        if self.do_pad:
            image = _pad_to_square(image, self.pad_color)
        if self.resize is not None:
            height, width = _resized(image.height, image.width, self.resize)
            if height * width > _MAX_RESIZED_PIXELS:  # (an extreme aspect ratio)
                raise ValueError(
                    f"a {image.width}x{image.height} image would be resized to {width}x{height} "
                    "pixels before its centre crop: the aspect ratio is too extreme"
                )
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
        if self.crop is not None:
            pixels = _center_crop(pixels, self.crop)
        out = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)


class LlavaImageInputs(MultiModalProcessor):
    """Images of LLaVA requests (module docstring): ``preprocessing`` makes an image's
    pixels, each image stands for ``tokens_per_image`` tokens of id ``image_token_id``."""

    def __init__(
        self, preprocessing: ClipPreprocessing, image_token_id: int, tokens_per_image: int
    ) -> None:
        self.preprocessing = preprocessing
        self.tokens_per_image = tokens_per_image
        self.placeholder_token_ids = {"image": int(image_token_id)}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> LlavaImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its
        ``preprocessor_config.json``) for the model of ``hf_config`` (its
        ``image_token_id`` and image-side settings); ``ValueError`` when the folder has no
        image processor config, or its pixels would not be the tower's square."""
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = LlavaVisionSpec.from_config(hf_config)
        preprocessing = ClipPreprocessing.from_dict(json.loads(path.read_text()))
        side = int(spec.vision_config.image_size)
        size = preprocessing.fixed_size()
        if size != (side, side):
            made = "images of varying sizes" if size is None else f"{size[0]}x{size[1]} pixels"
            raise ValueError(
                f"{path} makes {made}, but the vision tower takes {side}x{side} "
                "(image_size): its resize / crop settings are not supported"
            )
        return cls(preprocessing, image_token_id, spec.tokens_per_image)

    def prompt_placeholder(self, modality: str) -> str:
        return IMAGE_PLACEHOLDER

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.preprocessing)
        return self.tokens_per_image, {"pixel_values": torch.from_numpy(pixels)[None]}


def _resize_rule(size: Any) -> tuple[str, Any]:
    """``size`` of a config -> ``("shortest_edge", edge)`` or ``("exact", (h, w))``; an int
    is a shortest edge (these processors do not default to squares)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return ("shortest_edge", size)
    if isinstance(size, Mapping):
        if "longest_edge" in size:
            raise ValueError(f"size {dict(size)}: longest_edge is not supported")
        if "shortest_edge" in size:
            return ("shortest_edge", int(size["shortest_edge"]))
        if "height" in size and "width" in size:
            return ("exact", (int(size["height"]), int(size["width"])))
    raise ValueError(f"size {size!r} is not supported (shortest_edge, or height and width)")


def _resized(height: int, width: int, rule: tuple[str, Any]) -> tuple[int, int]:
    kind, value = rule
    if kind == "exact":
        return value
    short, long = min(height, width), max(height, width)
    new_long = int(value * long / short)
    return (new_long, value) if width <= height else (value, new_long)


def _square_or_pair(size: Any, name: str) -> tuple[int, int] | None:
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool):
        return (size, size)
    if isinstance(size, Mapping) and "height" in size and "width" in size:
        return (int(size["height"]), int(size["width"]))
    raise ValueError(f"{name} {size!r} is not supported (an integer, or height and width)")


def rgb_channels(values: Any, name: str) -> tuple[float, ...]:
    """A config's per-channel ``image_mean`` / ``image_std`` (``name``) as 3 floats, a
    single number meaning all three; ``ValueError`` for another count."""
    if isinstance(values, int | float):
        values = [values] * 3
    values = tuple(float(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 values (RGB); got {values}")
    return values


def _pad_to_square(image: Any, color: tuple[int, int, int]) -> Any:
    """``image`` centred on a square of ``color``."""
    from PIL import Image

    side = max(image.width, image.height)
    if image.width == image.height:
        return image
    square = Image.new("RGB", (side, side), color)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


def _center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """``[C, H, W]`` centre-cropped to ``crop`` (zero-padded where smaller), as HF does."""
    height, width = pixels.shape[1:]
    crop_h, crop_w = crop
    if crop_h > height or crop_w > width:  # pad with zeros (centred, extra at the end)
        new_h, new_w = max(crop_h, height), max(crop_w, width)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
        padded[:, top : top + height, left : left + width] = pixels
        pixels, height, width = padded, new_h, new_w
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return pixels[:, top : top + crop_h, left : left + crop_w]
