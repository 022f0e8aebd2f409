"""KV cache groups: which attention layers share a block table (docs/architecture.md, "KV
cache per group of layers").

A model whose layers mix sliding-window, chunked local (Llama 4) and full attention gets one
group per slice of layers of the same kind (the same window, or the same chunk size), every
group of one common size ``L`` (the fewest layers of any kind; a kind with more layers
becomes several groups, the last one possibly smaller). The KV cache is then ``L`` tensors
of ``num_blocks`` blocks, and layer ``j`` of every group uses tensor ``j``: a block id names a
slot in one group's layers only, so one block pool serves every group and a block costs
``L`` layers' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: the attention layers (by layer number) that read ``window``
    (``None``: every position), or, with ``chunk`` ``C`` (chunked local attention, window
    ``None``), positions ``floor(p / C) * C .. p`` from a query at ``p``."""

    window: int | None
    layer_ids: tuple[int, ...]
    chunk: int | None = None

    @property
    def keeps_every_position(self) -> bool:
        """Whether the group's blocks are kept for the whole request (full attention)."""
        return self.window is None and self.chunk is None


def single_group_window(group_windows: Sequence[int | None]) -> int | None:
    """The window every attention layer reads within when there is one KV cache group
    (``group_windows[0]``); ``None`` with several groups (no one window bounds them all)."""
    return group_windows[0] if len(group_windows) == 1 else None


def plan_kv_cache_groups(
    layer_windows: Sequence[int | None], layer_chunks: Sequence[int | None] | None = None
) -> list[KVCacheGroupSpec]:
    """The groups of the layers whose windows are ``layer_windows`` and whose attention
    chunks are ``layer_chunks`` (by layer number; ``None``: no chunks): full-attention groups
    first, then window groups by window, then chunk groups by chunk size; every group has
    ``L`` layers (the fewest of any kind), the last of a kind possibly fewer. One group of
    every layer when all layers are of one kind."""
    chunks = list(layer_chunks) if layer_chunks is not None else [None] * len(layer_windows)
    if len(chunks) != len(layer_windows):
        raise ValueError(
            f"layer_chunks has {len(chunks)} layers; layer_windows has {len(layer_windows)}"
        )
    kinds: dict[tuple[int | None, int | None], list[int]] = {}
    for layer, kind in enumerate(zip(layer_windows, chunks, strict=True)):
        if kind[0] is not None and kind[1] is not None:
            raise ValueError(
                f"layer {layer} has both a sliding window and attention chunks: KV cache "
                "groups of such layers are not built"
            )
        kinds.setdefault(kind, []).append(layer)
    if len(kinds) <= 1:
        window, chunk = next(iter(kinds), (None, None))
        return [KVCacheGroupSpec(window, tuple(range(len(layer_windows))), chunk)]
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda k: (k[1] is not None, k[0] is not None, k[0] or 0, k[1] or 0))
    return [
        KVCacheGroupSpec(kind[0], tuple(kinds[kind][i : i + size]), kind[1])
        for kind in order
        for i in range(0, len(kinds[kind]), size)
    ]


def layer_placement(
    groups: Sequence[KVCacheGroupSpec], num_layers: int
) -> tuple[list[int], list[int]]:
    """``(layer_group, layer_tensor)``: for each layer number, its group and the index of the
    cache tensor it uses (its place in its group)."""
    layer_group = [-1] * num_layers
    layer_tensor = [-1] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layer_ids):
            layer_group[layer] = g
            layer_tensor[layer] = j
    if -1 in layer_group:
        raise ValueError(f"layer {layer_group.index(-1)} is in no KV cache group")
    return layer_group, layer_tensor


def draft_layer_placement(
    groups: Sequence[KVCacheGroupSpec], draft_windows: Sequence[int | None]
) -> tuple[list[int], list[int]]:
    """``(layer_group, layer_tensor)`` of a draft model's layers (windows ``draft_windows``,
    by layer number) on the target's ``groups``.

    Each draft layer reads and writes at the block ids of a group that keeps every position
    it may read: a full group, or a window group whose window is at least the layer's
    (group 0, full, suits every layer; a chunk group, which releases the blocks before each
    request's current chunk, suits none). The layers with the fewest such groups are placed
    first, each in the least loaded one (ties: a window group before a full one, the
    smaller window first), and use the draft cache tensor of their place among the draft
    layers of that group. Draft layers of different groups share a tensor, as the target's
    do: a block id belongs to one group at a time.
    """
    if not groups or not groups[0].keeps_every_position:
        raise ValueError("the first KV cache group must be a full-attention group")

    def fits(window: int | None) -> list[int]:
        return [
            g
            for g, group in enumerate(groups)
            if group.chunk is None
            and (group.window is None or (window is not None and window <= group.window))
        ]

    load = [0] * len(groups)
    layer_group = [-1] * len(draft_windows)
    layer_tensor = [-1] * len(draft_windows)
    order = sorted(range(len(draft_windows)), key=lambda i: (len(fits(draft_windows[i])), i))
    for layer in order:
        g = min(
            fits(draft_windows[layer]),
            key=lambda g: (load[g], groups[g].window is None, groups[g].window or 0, g),
        )
        layer_group[layer] = g
        layer_tensor[layer] = load[g]
        load[g] += 1
    return layer_group, layer_tensor
