"""Multimodal inputs: what travels with a request from the front-end to the model.

The front-end turns each image of a request into a :class:`MultiModalFeature`: the model's
processed inputs for it (``pixel_values``, ``image_grid_thw`` for Qwen2-VL), where its
placeholder tokens sit in the prompt, and a content hash. The prompt holds ``length``
placeholder tokens per image (the image token id repeated), one per row the vision encoder
returns; the model runner replaces their embeddings by the encoder's rows. Features travel
inside :class:`~chassis.core.request.EngineCoreRequest` (msgspec, so tensors travel as
bytes) and the scheduler's new-request data.

The ``identifier`` keys the prefix cache: a KV block that covers any placeholder token of an
image is shared only with requests that have the same image at the same place (the
placeholder token ids alone are the same for every image).
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import torch

#: the modalities a request may carry (videos: Qwen2-VL and Qwen2.5-VL; audio: Qwen2-Audio)
MODALITIES = ("image", "video", "audio")


class MultiModalTensor(msgspec.Struct, array_like=True, frozen=True):
    """A tensor as it crosses the process boundary: its dtype name, shape and raw bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> MultiModalTensor:
        """Capture ``tensor`` (any device; a bfloat16 tensor keeps its dtype)."""
        t = tensor.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return cls(dtype=name, shape=list(t.shape), data=raw.numpy().tobytes())

    def to_tensor(self) -> torch.Tensor:
        """The tensor again, on the CPU (a new, writable copy)."""
        dtype = getattr(torch, self.dtype)
        if dtype == torch.bfloat16:
            array = np.frombuffer(self.data, dtype=np.int16).copy()
            return torch.from_numpy(array).view(torch.bfloat16).reshape(self.shape)
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        array = np.frombuffer(self.data, dtype=np_dtype).copy()
        return torch.from_numpy(array).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, kw_only=True, frozen=True):
    """One multimodal item (an image) of a request, processed for the model."""

    #: one of :data:`MODALITIES`
    modality: str
    #: content hash of the processed inputs (hex): keys the prefix cache and the runner's
    #: encoder-output cache
    identifier: str
    #: index in the prompt's token ids of the item's first placeholder token
    offset: int
    #: number of placeholder tokens (rows of the encoder's output for the item)
    length: int
    #: the model's processed inputs for this item alone, by name (Qwen2-VL: ``pixel_values``
    #: ``[patches, C*T*P*P]`` and ``image_grid_thw`` ``[1, 3]``)
    data: dict[str, MultiModalTensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        """:attr:`data` as CPU tensors."""
        return {name: value.to_tensor() for name, value in self.data.items()}

    @property
    def end(self) -> int:
        """One past the item's last placeholder token."""
        return self.offset + self.length


def feature_identifier(modality: str, tensors: dict[str, torch.Tensor]) -> str:
    """The content hash of an item's processed inputs: sha256 over the modality and every
    tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256(modality.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


def make_feature(
    modality: str, offset: int, length: int, tensors: dict[str, torch.Tensor]
) -> MultiModalFeature:
    """A :class:`MultiModalFeature` of ``tensors`` whose placeholders start at ``offset``."""
    if modality not in MODALITIES:
        raise ValueError(f"unknown modality {modality!r}; known: {', '.join(MODALITIES)}")
    if offset < 0 or length <= 0:
        raise ValueError(f"placeholder range offset={offset} length={length} is empty")
    return MultiModalFeature(
        modality=modality,
        identifier=feature_identifier(modality, tensors),
        offset=offset,
        length=length,
        data={name: MultiModalTensor.from_tensor(t) for name, t in tensors.items()},
    )
