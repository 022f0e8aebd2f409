"""Image (and audio) embeddings in place of the media (vLLM's ``image_embeds`` and
``audio_embeds``, behind ``--enable-mm-embeds``).

A caller that computed an image's rows itself (the model's own vision tower and projector,
run elsewhere) passes them instead of the image; the prompt's placeholder for it expands to
one token per row and the runner puts the rows in place of those tokens' embeddings without
running the tower. The forms taken are vLLM's, per model (its class attribute
``image_embeds_form``):

* ``"rows"`` (LLaVA-1.5, LLaVA-NeXT, InternVL, Aya Vision, Gemma 3): a float tensor
  ``[rows, hidden_size]`` is one image; ``[n, rows, hidden_size]`` is ``n`` images of ``rows``
  each;
* ``"grid"`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``{"image_embeds": [tokens, hidden_size],
  "image_grid_thw": [n, 3]}`` is ``n`` images, image ``i`` the next ``t * h * w /
  merge_size**2`` rows; the grid also gives the images' M-RoPE positions;
* ``"tiles"`` (Llama 4, whose run's tile separators need the image's tile grid):
  ``{"image_embeds": [rows, hidden_size], "aspect_ratios": [n, 2]}`` is ``n`` images, image
  ``i`` of ``r x c`` tiles (HF's ``aspect_ratios``) the next ``tiles(r, c) * per_tile`` rows,
  ``tiles`` being the model class's ``image_embeds_tiles`` (Llama 4's: ``r * c``, plus a
  global tile after a grid of several; ``per_tile`` the rows divided by all the images'
  tiles); a tensor alone takes the ``"rows"`` form's shapes, each image one tile (the
  model's processor refuses another count).

The rows' width is the language model's ``hidden_size`` unless the model's class says
otherwise (its classmethod ``image_embeds_width(hf_config)``: Qwen3-VL's rows carry its
deepstack rows beside them, ``hidden_size * (1 + K)``, as vLLM takes them). The model's
processor may check an item's row count and write its token run
(:meth:`~chassis.core.multimodal_processing.MultiModalProcessor.precomputed_item`: Aya Vision's
tiles, Gemma 3's fixed count). A model without a form (``None``) refuses embeddings naming
itself, with its ``image_embeds_refusal`` as the reason when it has one.

Each image becomes a :class:`PrecomputedItem` here, in the front-end; the model's processor
expands its placeholder to ``length`` tokens (:meth:`~chassis.core.multimodal_processing.
MultiModalProcessor.process`) and its feature's data is the rows (:data:`EMBEDS_KEY`) and,
for the grid form, the grid (``image_grid_thw`` ``[1, 3]``; the tiles form's item carries its
``aspect_ratios`` ``[1, 2]`` to the processor, which writes the run from it), so the
feature's identifier, which keys the prefix cache, is the hash of the rows. The runner hands a feature with
:data:`EMBEDS_KEY` to the encoder-output cache as it is (:mod:`chassis.core.
multimodal_runner`). Every refusal is a ``ValueError`` (the server's 400).

Audio clips' embeddings (vLLM's ``audio_embeds``: Qwen2-Audio's projector rows) take the
``"rows"`` form of a model whose class declares ``audio_embeds_form = "rows"``: a tensor
``[rows, hidden_size]`` is one clip, ``[n, rows, hidden_size]`` ``n`` clips (a 1-D tensor
stays a waveform); their rows are kept under ``"audio_embeds"`` (:func:`embeds_key`).
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
#: the name of the tile grids (rows, columns per image) in the tiles form and a feature's data
ASPECT_KEY = "aspect_ratios"
#: the forms a model may declare as ``image_embeds_form`` (``audio_embeds_form``: ``"rows"``)
EMBEDS_FORMS = ("rows", "grid", "tiles")
#: the modalities whose items may be embeddings
EMBEDS_MODALITIES = ("image", "audio")
#: the most bytes one chat ``image_embeds`` payload may decode to (base64 decoded)
MAX_EMBEDS_BYTES = 256 * 1024 * 1024
#: the flag, as messages name it
FLAG = "--enable-mm-embeds (enable_mm_embeds=True offline)"


@dataclass(frozen=True)
class PrecomputedItem:
    """One item whose rows the caller gave: its placeholder count and its feature's data."""

    length: int
    tensors: dict[str, torch.Tensor]


def embeds_key(modality: str) -> str:
    """The name of an item's given rows in its feature's data: ``"image_embeds"``,
    ``"audio_embeds"`` (vLLM's names)."""
    return f"{modality}_embeds"


def is_embeds_item(item: Any, modality: str = "image") -> bool:
    """Whether a ``multi_modal_data`` item of ``modality`` is embeddings rather than the
    medium itself: for images a tensor or a mapping holding :data:`EMBEDS_KEY`; for audio
    a tensor of two or more dimensions (a 1-D tensor is a waveform) or a mapping holding
    ``"audio_embeds"``; never for videos."""
    if modality not in EMBEDS_MODALITIES:
        return False
    if isinstance(item, Mapping):
        return embeds_key(modality) in item
    return isinstance(item, torch.Tensor) and (modality == "image" or item.dim() >= 2)


def flag_refusal(modality: str = "image") -> str:
    """The message for embeddings sent to an engine without the flag."""
    return f"{modality} embeddings are taken only when the engine runs with {FLAG}"


def precomputed_items(
    items: Sequence[Any], model_cls: Any, hf_config: Any, model_name: str, modality: str = "image"
) -> list[Any]:
    """A request's items of ``modality`` (``"image"`` or ``"audio"``) with each embeddings
    item replaced by its items as :class:`PrecomputedItem` (one tensor or dict may hold
    several), in order; the media themselves are kept as they are. ``ValueError`` for a
    model that takes none (naming it; its class attribute ``<modality>_embeds_form``), or a
    tensor of the wrong dtype kind, rank, width or row count (module docstring). Audio
    embeddings take the ``"rows"`` form only."""
    if not any(is_embeds_item(item, modality) for item in items):
        return list(items)
    form = getattr(model_cls, f"{modality}_embeds_form", None)
    if form not in (EMBEDS_FORMS if modality == "image" else ("rows",)):
        reason = getattr(model_cls, f"{modality}_embeds_refusal", None)
        noun = "images" if modality == "image" else "audio clips"
        raise ValueError(
            f"model {model_name!r} ({model_cls.__name__}) does not take {modality} embeddings"
            + (f": {reason}" if reason else "")
            + f"; send the {noun} themselves"
        )
    hidden = int(hf_config.hidden_size)
    # (the class's width is its images'; audio rows are the hidden size wide)
    width_of = getattr(model_cls, "image_embeds_width", None) if modality == "image" else None
    width = _Width(hidden, "the language model's hidden size")
    if width_of is not None:
        width = _Width(
            int(width_of(hf_config)),
            f"{model_cls.__name__}'s image embedding width (the language model's hidden size "
            f"{hidden} times 1 + its deepstack sets)",
        )
    out: list[Any] = []
    for item in items:
        if not is_embeds_item(item, modality):
            out.append(item)
        elif form == "rows" or (form == "tiles" and not isinstance(item, Mapping)):
            out.extend(_rows_items(item, width, model_cls.__name__, modality))
        elif form == "tiles":
            out.extend(_tiles_items(item, width, model_cls))
        else:
            merge = int(_field(hf_config.vision_config, "spatial_merge_size"))
            out.extend(_grid_items(item, width, merge, model_cls.__name__))
    return out


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name)


@dataclass(frozen=True)
class _Width:
    """The width image embeddings must have, and what it is (for messages)."""

    size: int
    meaning: str


def _check_rows(rows: Any, width: _Width, what: str) -> torch.Tensor:
    """``rows`` checked: a floating-point tensor whose last dimension is ``hidden``, with
    rows; returned detached, contiguous, on the CPU."""
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor; got {type(rows).__name__}")
    if not rows.is_floating_point():
        raise ValueError(
            f"{what} must be a floating-point tensor (the model's input embeddings); got "
            f"dtype {str(rows.dtype).removeprefix('torch.')}"
        )
    if rows.dim() < 2 or rows.shape[-1] != width.size:
        raise ValueError(
            f"{what} has shape {tuple(rows.shape)}; its last dimension must be "
            f"{width.meaning} {width.size}"
        )
    if rows.numel() == 0:
        raise ValueError(f"{what} has shape {tuple(rows.shape)}: no rows")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{what} holds non-finite values (inf or nan)")
    return rows.detach().to("cpu").contiguous()


def _rows_items(item: Any, width: _Width, model: str, modality: str) -> list[PrecomputedItem]:
    """A ``"rows"`` model's item: ``[rows, hidden]`` (one item) or ``[n, rows, hidden]``."""
    many = "images" if modality == "image" else "clips"
    if isinstance(item, Mapping):
        raise ValueError(
            f"{model} takes {modality} embeddings as a tensor [rows, hidden_size] (one "
            f"{modality} item) or [{many}, rows, hidden_size]; got a dict with "
            f"{sorted(map(str, item))}"
        )
    rows = _check_rows(item, width, f"{modality} embeddings")
    hidden = width.size
    if rows.dim() > 3:
        raise ValueError(
            f"{modality} embeddings have shape {tuple(rows.shape)}; expected [rows, {hidden}] "
            f"or [{many}, rows, {hidden}]"
        )
    key = embeds_key(modality)
    chunks = [rows] if rows.dim() == 2 else list(rows.unbind(0))
    return [PrecomputedItem(len(r), {key: r.contiguous()}) for r in chunks]


def _grid_items(item: Any, width: _Width, merge: int, model: str) -> list[PrecomputedItem]:
    """A ``"grid"`` model's item: the rows of ``n`` images and their ``[n, 3]`` grid."""
    hidden = width.size
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
    rows = _check_rows(item[EMBEDS_KEY], width, EMBEDS_KEY)
    if rows.dim() != 2:
        raise ValueError(f"{EMBEDS_KEY} has shape {tuple(rows.shape)}; expected [tokens, {hidden}]")
    grid = _int_table(
        item[GRID_KEY], 3, f"{GRID_KEY} must be integers [images, 3] (t, h, w per image)"
    )
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


def _tiles_items(item: Mapping[Any, Any], width: _Width, model_cls: type) -> list[PrecomputedItem]:
    """A ``"tiles"`` model's dict: the rows of ``n`` images and their ``[n, 2]`` tile grids
    (module docstring), one item each with its ``aspect_ratios`` ``[1, 2]``; the model
    class's ``image_embeds_tiles(rows, columns)`` gives each image's tile count."""
    model = model_cls.__name__
    hidden = width.size
    form = f'{{"{EMBEDS_KEY}": [rows, {hidden}], "{ASPECT_KEY}": [images, 2]}}'
    unknown = sorted(set(map(str, item)) - {EMBEDS_KEY, ASPECT_KEY})
    if unknown or ASPECT_KEY not in item:
        raise ValueError(
            f"{model} takes image embeddings as a dict {form} (each image's tile rows and "
            f"columns), or a tensor of one-tile images; got keys {sorted(map(str, item))}"
        )
    rows = _check_rows(item[EMBEDS_KEY], width, EMBEDS_KEY)
    if rows.dim() != 2:
        raise ValueError(f"{EMBEDS_KEY} has shape {tuple(rows.shape)}; expected [rows, {hidden}]")
    grids = _int_table(
        item[ASPECT_KEY], 2, f"{ASPECT_KEY} must be integers [images, 2] (tile rows, columns)"
    )
    if bool((grids < 1).any()):
        raise ValueError(f"{ASPECT_KEY} {grids.tolist()}: tile rows and columns must be >= 1")
    tiles = [int(model_cls.image_embeds_tiles(r, c)) for r, c in grids.tolist()]
    per_tile, rest = divmod(rows.shape[0], sum(tiles))
    if rest or not per_tile:
        raise ValueError(
            f"{EMBEDS_KEY} has {rows.shape[0]} rows, not a multiple of the {sum(tiles)} tiles "
            f"{ASPECT_KEY} {grids.tolist()} gives ({tiles} per image: {model}'s tile count "
            "for each grid)"
        )
    out: list[PrecomputedItem] = []
    start = 0
    for i, count in enumerate(tiles):
        length = count * per_tile
        chunk = rows[start : start + length].contiguous()
        out.append(
            PrecomputedItem(length, {EMBEDS_KEY: chunk, ASPECT_KEY: grids[i : i + 1].clone()})
        )
        start += length
    return out


def _int_table(value: Any, columns: int, message: str) -> torch.Tensor:
    """``value`` (a tensor or nested list of integers ``[images, columns]``, or one image's
    ``[columns]``) as an int64 CPU tensor ``[images, columns]``; ``ValueError(message)`` for
    anything else (no other shape is re-read as rows of ``columns``)."""
    if isinstance(value, list | tuple):
        try:
            value = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):  # ragged, or not numbers
            raise ValueError(message) from None
    if (
        not isinstance(value, torch.Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
        or value.numel() == 0
        or value.dim() not in (1, 2)
        or value.shape[-1] != columns
    ):
        raise ValueError(message)
    return value.detach().to("cpu", torch.int64).reshape(-1, columns)


def load_embeds(value: Any, modality: str = "image") -> Any:
    """A chat ``image_embeds`` (``audio_embeds``) part's payload as ``multi_modal_data``
    takes it: a base64
    string of a ``torch.save``'d tensor (vLLM's) -> the tensor; a dict of such strings (or
    tensors, or for the grid a list of integers) -> the dict of tensors; a tensor (offline)
    as it is. Loaded with ``torch.load(weights_only=True)`` (plain tensors only, no code),
    each payload at most :data:`MAX_EMBEDS_BYTES`; ``ValueError`` otherwise."""
    if isinstance(value, torch.Tensor):
        return value
    key = embeds_key(modality)
    if isinstance(value, str):
        return _load_base64_tensor(value, key)
    if modality == "audio":
        raise ValueError(
            "an audio_embeds part needs 'audio_embeds': the base64 of a torch.save'd tensor "
            "[rows, hidden_size]"
        )
    if isinstance(value, Mapping) and value:
        return {
            str(key): _load_base64_tensor(v, str(key)) if isinstance(v, str) else v
            for key, v in value.items()
        }
    raise ValueError(
        "an image_embeds part needs 'image_embeds': the base64 of a torch.save'd tensor, or "
        f"a dict of them ({EMBEDS_KEY}, {GRID_KEY} or {ASPECT_KEY}) for models that take a "
        "grid"
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
