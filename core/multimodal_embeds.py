"""Image embeddings in place of images (vLLM's ``image_embeds``, behind ``--enable-mm-embeds``).

A caller that computed an image's rows itself (the model's own vision tower and projector,
run elsewhere) passes them instead of the image; the prompt's placeholder for it expands to
one token per row and the runner puts the rows in place of those tokens' embeddings without
running the tower. The forms taken are vLLM's, per model (its class attribute
``image_embeds_form``):

* ``"rows"`` (LLaVA-1.5, LLaVA-NeXT): a float tensor ``[rows, hidden_size]`` is one image;
  ``[n, rows, hidden_size]`` is ``n`` images of ``rows`` each;
* ``"grid"`` (Qwen2-VL, Qwen2.5-VL): ``{"image_embeds": [tokens, hidden_size],
  "image_grid_thw": [n, 3]}`` is ``n`` images, image ``i`` the next ``t * h * w /
  merge_size**2`` rows; the grid also gives the images' M-RoPE positions.

A model without a form (``None``) refuses embeddings naming itself, with its
``image_embeds_refusal`` as the reason when it has one (Qwen3-VL: its deepstack rows).

Each image becomes a :class:`PrecomputedItem` here, in the front-end; the model's processor
expands its placeholder to ``length`` tokens (:meth:`~chassis.core.multimodal_processing.
MultiModalProcessor.process`) and its feature's data is the rows (:data:`EMBEDS_KEY`) and,
for the grid form, the grid (``image_grid_thw`` ``[1, 3]``), so the feature's identifier,
which keys the prefix cache, is the hash of the rows. The runner hands a feature with
:data:`EMBEDS_KEY` to the encoder-output cache as it is (:mod:`chassis.core.
multimodal_runner`). Every refusal is a ``ValueError`` (the server's 400).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the name of an item's rows in its feature's data (and of the rows in the grid form)
EMBEDS_KEY = "image_embeds"
#: the name of the grid in the grid form and in a feature's data
GRID_KEY = "image_grid_thw"
#: the forms a model may declare as ``image_embeds_form``
EMBEDS_FORMS = ("rows", "grid")
#: the most bytes one chat ``image_embeds`` payload may decode to (base64 decoded)
MAX_EMBEDS_BYTES = 256 * 1024 * 1024
#: the flag, as messages name it
FLAG = "--enable-mm-embeds (enable_mm_embeds=True offline)"


@dataclass(frozen=True)
class PrecomputedItem:
    """One item whose rows the caller gave: its placeholder count and its feature's data."""

    length: int
    tensors: dict[str, torch.Tensor]


def is_embeds_item(item: Any) -> bool:
    """Whether a ``multi_modal_data`` item is embeddings (a tensor, or a mapping holding
    :data:`EMBEDS_KEY`) rather than an image."""
    return isinstance(item, torch.Tensor) or (isinstance(item, Mapping) and EMBEDS_KEY in item)


def flag_refusal() -> str:
    """The message for embeddings sent to an engine without the flag."""
    return f"image embeddings are taken only when the engine runs with {FLAG}"


def precomputed_items(
    items: Sequence[Any], model_cls: Any, hf_config: Any, model_name: str
) -> list[Any]:
    """A request's ``"image"`` items with each embeddings item replaced by its images as
    :class:`PrecomputedItem` (one tensor or dict may hold several), in order; images are
    kept as they are. ``ValueError`` for a model that takes none (naming it), or a tensor
    of the wrong dtype kind, rank, width or row count (module docstring). (Only images:
    other modalities' items go to the model's processor as they are.)"""
    if not any(is_embeds_item(item) for item in items):
        return list(items)
    form = getattr(model_cls, "image_embeds_form", None)
    if form not in EMBEDS_FORMS:
        reason = getattr(model_cls, "image_embeds_refusal", None)
        raise ValueError(
            f"model {model_name!r} ({model_cls.__name__}) does not take image embeddings"
            + (f": {reason}" if reason else "")
            + "; send the images themselves"
        )
    hidden = int(hf_config.hidden_size)
    out: list[Any] = []
    for item in items:
        if not is_embeds_item(item):
            out.append(item)
        elif form == "rows":
            out.extend(_rows_items(item, hidden, model_cls.__name__))
        else:
            merge = int(_field(hf_config.vision_config, "spatial_merge_size"))
            out.extend(_grid_items(item, hidden, merge, model_cls.__name__))
    return out


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name)


def _check_rows(rows: Any, hidden: int, what: str) -> torch.Tensor:
    """``rows`` checked: a floating-point tensor whose last dimension is ``hidden``, with
    rows; returned detached, contiguous, on the CPU."""
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor; got {type(rows).__name__}")
    if not rows.is_floating_point():
        raise ValueError(
            f"{what} must be a floating-point tensor (the model's input embeddings); got "
            f"dtype {str(rows.dtype).removeprefix('torch.')}"
        )
    if rows.dim() < 2 or rows.shape[-1] != hidden:
        raise ValueError(
            f"{what} has shape {tuple(rows.shape)}; its last dimension must be the language "
            f"model's hidden size {hidden}"
        )
    if rows.numel() == 0:
        raise ValueError(f"{what} has shape {tuple(rows.shape)}: no rows")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{what} holds non-finite values (inf or nan)")
    return rows.detach().to("cpu").contiguous()


def _rows_items(item: Any, hidden: int, model: str) -> list[PrecomputedItem]:
    """A ``"rows"`` model's item: ``[rows, hidden]`` (one image) or ``[n, rows, hidden]``."""
    if isinstance(item, Mapping):
        raise ValueError(
            f"{model} takes image embeddings as a tensor [rows, hidden_size] (one image) or "
            f"[images, rows, hidden_size]; got a dict with {sorted(map(str, item))}"
        )
    rows = _check_rows(item, hidden, "image embeddings")
    if rows.dim() > 3:
        raise ValueError(
            f"image embeddings have shape {tuple(rows.shape)}; expected [rows, {hidden}] or "
            f"[images, rows, {hidden}]"
        )
    images = [rows] if rows.dim() == 2 else list(rows.unbind(0))
    return [PrecomputedItem(len(r), {EMBEDS_KEY: r.contiguous()}) for r in images]


def _grid_items(item: Any, hidden: int, merge: int, model: str) -> list[PrecomputedItem]:
    """A ``"grid"`` model's item: the rows of ``n`` images and their ``[n, 3]`` grid."""
    form = f'{{"{EMBEDS_KEY}": [tokens, {hidden}], "{GRID_KEY}": [images, 3]}}'
    if not isinstance(item, Mapping):
        raise ValueError(
            f"{model} takes image embeddings as a dict {form} (the grid gives each image's "
            "token count and rotary positions); got a tensor alone"
        )
    unknown = sorted(set(map(str, item)) - {EMBEDS_KEY, GRID_KEY})
    if unknown or GRID_KEY not in item:
        raise ValueError(
            f"{model} takes image embeddings as a dict {form}; got keys {sorted(map(str, item))}"
        )
    rows = _check_rows(item[EMBEDS_KEY], hidden, EMBEDS_KEY)
    if rows.dim() != 2:
        raise ValueError(f"{EMBEDS_KEY} has shape {tuple(rows.shape)}; expected [tokens, {hidden}]")
    grid = item[GRID_KEY]
    if isinstance(grid, list | tuple):
        grid = torch.tensor(grid)
    if (
        not isinstance(grid, torch.Tensor)
        or grid.is_floating_point()
        or grid.is_complex()
        or grid.dtype == torch.bool
        or grid.numel() == 0
        or grid.numel() % 3
    ):
        raise ValueError(f"{GRID_KEY} must be integers [images, 3] (t, h, w per image)")
    grid = grid.detach().to("cpu", torch.int64).reshape(-1, 3)
    if bool((grid < 1).any()) or bool((grid[:, 1:] % merge).any()):
        raise ValueError(
            f"{GRID_KEY} {grid.tolist()}: every t, h, w must be >= 1 and h, w multiples of "
            f"the vision tower's spatial_merge_size {merge}"
        )
    lengths = [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]
    if sum(lengths) != rows.shape[0]:
        raise ValueError(
            f"{EMBEDS_KEY} has {rows.shape[0]} rows but {GRID_KEY} {grid.tolist()} gives "
            f"{' + '.join(map(str, lengths))} = {sum(lengths)} (t * h * w / "
            f"{merge * merge} per image)"
        )
    out: list[PrecomputedItem] = []
    start = 0
    for i, length in enumerate(lengths):
        chunk = rows[start : start + length].contiguous()
        out.append(PrecomputedItem(length, {EMBEDS_KEY: chunk, GRID_KEY: grid[i : i + 1].clone()}))
        start += length
    return out


def load_embeds(value: Any) -> Any:
    """A chat ``image_embeds`` part's payload as ``multi_modal_data`` takes it: a base64
    string of a ``torch.save``'d tensor (vLLM's) -> the tensor; a dict of such strings (or
    tensors, or for the grid a list of integers) -> the dict of tensors; a tensor (offline)
    as it is. Loaded with ``torch.load(weights_only=True)`` (plain tensors only, no code),
    each payload at most :data:`MAX_EMBEDS_BYTES`; ``ValueError`` otherwise."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, str):
        return _load_base64_tensor(value, EMBEDS_KEY)
    if isinstance(value, Mapping) and value:
        return {
            str(key): _load_base64_tensor(v, str(key)) if isinstance(v, str) else v
            for key, v in value.items()
        }
    raise ValueError(
        "an image_embeds part needs 'image_embeds': the base64 of a torch.save'd tensor, or "
        f"a dict of them ({EMBEDS_KEY}, {GRID_KEY}) for models that take a grid"
    )


def _load_base64_tensor(text: str, name: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote, from its base64 (``name`` for messages)."""
    if len(text) > (MAX_EMBEDS_BYTES // 3 + 1) * 4:
        raise ValueError(f"{name} is over the {MAX_EMBEDS_BYTES >> 20} MiB limit")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64") from None
    try:
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # (pickle, zip and torch errors alike: the payload is bad)
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{name} is not a torch.save'd tensor ({type(exc).__name__}: {why})"
        ) from None
    if not isinstance(loaded, torch.Tensor):
        raise ValueError(f"{name} holds a {type(loaded).__name__}, not a tensor")
    return loaded
