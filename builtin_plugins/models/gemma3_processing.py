"""Gemma 3 images -> the model's inputs, as transformers' ``Gemma3Processor`` over its
``Gemma3ImageProcessor`` (PIL backend), in PIL and numpy; pan-and-scan is not supported.

Pixels (``preprocessor_config.json``): RGB, resized to ``size`` (``height`` x ``width``,
the tower's ``image_size`` square; PIL's ``resample``, bilinear in the released configs),
``* rescale_factor`` and ``(x - mean) / std`` (0.5 and 0.5 unless the config says otherwise):
``pixel_values`` ``[1, 3, S, S]`` float32, the steps of
:class:`~.llava_processing.ClipPreprocessing`.

Prompt: Gemma 3's chat template writes ``<start_of_image>`` (the ``boi`` token) where an image
goes; each becomes, as ``Gemma3Processor`` expands it, ``"\\n\\n"``, ``<start_of_image>``,
``mm_tokens_per_image`` x ``<image_soft_token>`` (the image's placeholder tokens: the
feature's range), ``<end_of_image>``, ``"\\n\\n"``. HF expands the text before tokenizing it;
this expansion works on token ids, so where an inserted ``"\\n\\n"`` meets a newline token of
the prompt the two become the single token of the longer newline run when the vocabulary has
one (Gemma's tokenizer has runs of newlines as single tokens: ``"user\\n" + "\\n\\n"`` is
``"user"``, ``"\\n\\n\\n"``), as the tokenizer would have made them (vLLM merges the same).
``mm_processor_kwargs``: only ``{"do_pan_and_scan": false}`` (the default) is taken. Image
embeddings (``--enable-mm-embeds``) are ``mm_tokens_per_image`` rows an image, framed alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_processing import ClipPreprocessing
from chassis.core.multimodal import MultiModalFeature
from chassis.core.multimodal_embeds import PrecomputedItem
from chassis.core.multimodal_processing import MultiModalProcessor

#: the text standing for one image in a Gemma 3 prompt (the chat template's)
BOI_TEXT = "<start_of_image>"
#: what inserted newlines may merge into: runs up to this long
_MAX_NEWLINE_RUN = 32
_BILINEAR = 2


def gemma3_preprocessing(config: Mapping[str, Any], image_size: int) -> ClipPreprocessing:
    """The steps of a Gemma 3 ``preprocessor_config.json``; ``ValueError`` for another
    processor type, pan-and-scan, or pixels that would not be the tower's square."""
    kind = str(config.get("image_processor_type") or "Gemma3ImageProcessor")
    kind = kind.removesuffix("Fast").removesuffix("Pil")
    if kind != "Gemma3ImageProcessor":
        raise ValueError(f"image processor {kind!r} is not supported for Gemma 3 images")
    if config.get("do_pan_and_scan"):
        raise ValueError("do_pan_and_scan is not supported for Gemma 3 images")

    def flag(name: str) -> bool:
        value = config.get(name)
        return True if value is None else bool(value)

    size = config.get("size") or {"height": 224, "width": 224}
    if isinstance(size, int) and not isinstance(size, bool):
        size = {"height": size, "width": size}
    if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
        raise ValueError(f"size {size!r} is not supported (height and width)")
    shape = (int(size["height"]), int(size["width"]))
    if not flag("do_resize") or shape != (image_size, image_size):
        raise ValueError(
            f"the image processor makes {'unresized images' if not flag('do_resize') else shape}, "
            f"but the vision tower takes {image_size}x{image_size} (image_size)"
        )
    mean = _channels(config.get("image_mean"), "image_mean")
    std = _channels(config.get("image_std"), "image_std")
    rescale = config.get("rescale_factor")
    return ClipPreprocessing(
        do_pad=False,
        pad_color=(0, 0, 0),
        resize=("exact", shape),
        resample=int(config.get("resample") or _BILINEAR),
        crop=None,
        rescale_factor=(float(rescale) if rescale is not None else 1 / 255)
        if flag("do_rescale")
        else None,
        mean=mean if flag("do_normalize") else None,
        std=std if flag("do_normalize") else None,
    )


class Gemma3ImageInputs(MultiModalProcessor):
    """Images of Gemma 3 requests (module docstring): the prompt's ``boi`` token stands for
    an image; each image is ``tokens_per_image`` placeholder tokens of ``image_token_id``
    framed as ``Gemma3Processor`` frames them."""

    def __init__(
        self,
        preprocessing: ClipPreprocessing,
        *,
        boi_token_id: int,
        eoi_token_id: int,
        image_token_id: int,
        tokens_per_image: int,
        double_newline: Sequence[int],
        newline_runs: Mapping[int, int],
    ) -> None:
        """``double_newline``: the token ids of ``"\\n\\n"``; ``newline_runs``: run length
        -> the token of that many newlines, for the runs the vocabulary has as one token."""
        self.preprocessing = preprocessing
        self.placeholder_token_ids = {"image": int(boi_token_id)}
        self.eoi_token_id = int(eoi_token_id)
        self.image_token_id = int(image_token_id)
        self.tokens_per_image = int(tokens_per_image)
        self.double_newline = list(double_newline)
        self.run_token = dict(newline_runs)
        self.run_length = {token: length for length, token in self.run_token.items()}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Gemma3ImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its ``preprocessor_config.json``
        and tokenizer) for the model of ``hf_config``; ``ValueError`` when a file or setting
        is missing or not supported."""
        from chassis.core.tokenizer import load_tokenizer

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(
                f"the checkpoint {str(model_dir)!r} has no preprocessor_config.json: its image "
                "processor settings are unknown, so it cannot take images"
            )
        ids = {
            name: getattr(hf_config, name, None)
            for name in ("boi_token_id", "eoi_token_id", "image_token_id", "mm_tokens_per_image")
        }
        missing = sorted(name for name, value in ids.items() if value is None)
        if missing:
            raise ValueError(
                f"the model's config lacks {', '.join(missing)}: it cannot take images"
            )
        vision = hf_config.vision_config
        preprocessing = gemma3_preprocessing(json.loads(path.read_text()), int(vision.image_size))
        tokenizer = load_tokenizer(model_dir)
        runs = {}
        for length in range(1, _MAX_NEWLINE_RUN + 1):
            encoded = tokenizer.encode("\n" * length, add_special_tokens=False)
            if len(encoded) == 1:
                runs[length] = encoded[0]
        return cls(
            preprocessing,
            boi_token_id=ids["boi_token_id"],
            eoi_token_id=ids["eoi_token_id"],
            image_token_id=ids["image_token_id"],
            tokens_per_image=ids["mm_tokens_per_image"],
            double_newline=tokenizer.encode("\n\n", add_special_tokens=False),
            newline_runs=runs,
        )

    def prompt_placeholder(self, modality: str) -> str:
        return BOI_TEXT

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Only ``do_pan_and_scan`` false (HF's default) is taken."""
        if kwargs.get("do_pan_and_scan"):
            raise ValueError("do_pan_and_scan is not supported for Gemma 3 images")
        others = sorted(set(kwargs) - {"do_pan_and_scan"})
        if others:
            raise ValueError(f"mm_processor_kwargs are not supported by this model; got {others}")

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        pixels = preprocess_image(item, self.preprocessing)
        return self.tokens_per_image, {"pixel_values": torch.from_numpy(pixels)[None]}

    def precomputed_item(
        self, modality: str, item: PrecomputedItem
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Image embeddings: exactly ``tokens_per_image`` rows an image (what the projector
        gives; no pan-and-scan crops); ``ValueError`` for another count."""
        if item.length != self.tokens_per_image:
            raise ValueError(
                f"Gemma 3 image embeddings have {item.length} rows; an image has "
                f"{self.tokens_per_image} (the config's mm_tokens_per_image)"
            )
        return item.length, item.tensors

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """As :meth:`MultiModalProcessor.process`, each ``boi`` token expanded to Gemma 3's
        framed image (module docstring); the features' ranges are the soft tokens."""
        boi = self.placeholder_token_ids["image"]
        # the base class checks the counts and kwargs and processes the items; its own
        # expansion (boi repeated) is not Gemma's, so only its features' tensors are kept
        _, plain = super().process(prompt_token_ids, items, kwargs)
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        merge_next = False
        for token in prompt_token_ids:
            if token != boi:
                self._append(expanded, token, merge=merge_next)
                merge_next = False
                continue
            for newline in self.double_newline:
                self._append(expanded, newline, merge=True)
            expanded.append(boi)
            image = msgspec.structs.replace(plain[len(features)], offset=len(expanded))
            features.append(image)
            expanded.extend([self.image_token_id] * image.length)
            expanded.append(self.eoi_token_id)
            expanded.extend(self.double_newline)
            merge_next = True
        return expanded, features

    def _append(self, tokens: list[int], token: int, *, merge: bool) -> None:
        """Append ``token``; with ``merge``, a newline run meeting the newline run before it
        becomes one token when the vocabulary has the longer run."""
        if merge and tokens and tokens[-1] in self.run_length and token in self.run_length:
            merged = self.run_token.get(self.run_length[tokens[-1]] + self.run_length[token])
            if merged is not None:
                tokens[-1] = merged
                return
        tokens.append(token)


def _channels(values: Any, name: str) -> tuple[float, float, float]:
    if values is None:
        return (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN / _STD
    if isinstance(values, int | float):
        values = [values] * 3
    result = tuple(float(v) for v in values)
    if len(result) != 3:
        raise ValueError(f"{name} must have 3 values (RGB); got {result}")
    return result[0], result[1], result[2]
