"""KV cache groups: which attention layers share a block table (docs/architecture.md, "KV
cache per group of layers").

A model whose layers mix sliding-window and full attention gets one group per slice of
layers that read the same window, every group of one common size ``L`` (the fewest layers
of any window; a kind with more layers becomes several groups, the last one possibly
smaller). The KV cache is then ``L`` tensors of ``num_blocks`` blocks, and layer ``j`` of
every group uses tensor ``j``: a block id names a slot in one group's layers only, so one
block pool serves every group and a block costs ``L`` layers' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: the attention layers (by layer number) that read ``window``
    (``None``: every position)."""

    window: int | None
    layer_ids: tuple[int, ...]


def single_group_window(group_windows: Sequence[int | None]) -> int | None:
    """The window every attention layer reads within when there is one KV cache group
    (``group_windows[0]``); ``None`` with several groups (no one window bounds them all)."""
    return group_windows[0] if len(group_windows) == 1 else None


def plan_kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """The groups of the layers whose windows are ``layer_windows`` (by layer number):
    full-attention groups first, then window groups by window; every group has ``L`` layers
    (the fewest of any window), the last of a kind possibly fewer. One group of every layer
    when all layers read the same window."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) <= 1:
        window = next(iter(kinds), None)
        return [KVCacheGroupSpec(window, tuple(range(len(layer_windows))))]
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return [
        KVCacheGroupSpec(window, tuple(kinds[window][i : i + size]))
        for window in order
        for i in range(0, len(kinds[window]), size)
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
