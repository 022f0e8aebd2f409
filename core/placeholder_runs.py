"""Items whose placeholder run holds other tokens than the placeholder.

Some processors write more than copies of the placeholder token for an item: Mistral 3 ends
each row of ``[IMG]`` tokens with ``[IMG_BREAK]`` (and the image with ``[IMG_END]``), Aya
Vision labels each tile (``TILE_1`` ... ``TILE_GLOBAL``) between ``<|START_OF_IMG|>`` and
``<|END_OF_IMG|>``, Qwen3-VL writes a timestamp and frame delimiters around each group of a
video's ``<|video_pad|>`` tokens. The item's feature then covers its whole run and carries
the run's token ids (:data:`PLACEHOLDER_IDS_KEY`); the front-end writes them into the
expanded prompt (:func:`write_placeholder_runs`), and the model's ``embed_multimodal``
returns one row per token of the run: the encoder's rows at the item's own token, the token
embeddings elsewhere (:func:`splice_item_rows`), which is what HF computes there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chassis.core.multimodal import MultiModalFeature

#: the name, in an item's tensors, of the token ids of its whole run
PLACEHOLDER_IDS_KEY = "placeholder_ids"


def write_placeholder_runs(expanded: list[int], features: Sequence[MultiModalFeature]) -> list[int]:
    """``expanded`` (modified in place and returned) with the placeholder run of each
    feature whose data carries :data:`PLACEHOLDER_IDS_KEY` replaced by those token ids (what
    :meth:`~chassis.core.multimodal_processing.MultiModalProcessor.process` expanded to
    copies of the placeholder); features without it are left as they are."""
    for feature in features:
        run = feature.data.get(PLACEHOLDER_IDS_KEY)
        if run is not None:
            expanded[feature.offset : feature.end] = run.to_tensor().tolist()
    return expanded


def splice_item_rows(
    token_rows: torch.Tensor,
    run: torch.Tensor,
    item_token_id: int,
    item_rows: torch.Tensor,
    modality: str,
) -> torch.Tensor:
    """``token_rows`` (``[length, width]``, the embeddings of the run's tokens ``run``;
    modified in place and returned) with the rows at the tokens ``item_token_id`` replaced by
    ``item_rows``, in order, cast to their dtype. ``ValueError`` when the run holds another
    number of such tokens than ``item_rows`` has rows."""
    is_item = run == item_token_id
    count = int(is_item.sum())
    if count != item_rows.shape[0]:
        raise ValueError(
            f"the {modality} gives {item_rows.shape[0]} rows, but its placeholder run holds "
            f"{count} {modality} tokens"
        )
    token_rows[is_item] = item_rows.to(token_rows.dtype)
    return token_rows
