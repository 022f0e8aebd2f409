"""One host-to-device copy of a step's attention metadata, every KV cache group's included.

A step's attention metadata is ``query_start_loc`` and ``seq_lens`` (shared by every KV cache
group) plus, per group, a block table and a slot mapping. Copied one by one that is
``2 + 2G`` copies per step (each a launch, and with pinned memory a pinned staging
tensor); :func:`pack_step_metadata` writes them all into one flat int32 host tensor (pinned
when asked) and :func:`unpack_step_metadata` cuts its device copy back into per-group views,
so a step makes one copy whatever the number of groups. :func:`packed_forward_context` is
what the model runner calls; ``chassis.core.model_runner.step_forward_context`` (one copy per
array) is the reference it is tested against.

Layout, in int32 words, for ``R`` requests, ``T`` tokens, ``G`` groups and tables ``B``
entries wide::

    [0, R + 1)            query_start_loc
    [R + 1, 2R + 1)       seq_lens
    (one padding word: 2R + 1 is odd, and the int64 part starts 8-byte aligned)
    [o, o + 2GT)          the slot mappings: the bytes of an int64 [G, T] array
    [o + 2GT, end)        the block tables, [G, R, B]

The slot mappings are written through an int64 view of the host array and read through an
int64 view of the device tensor: the same bytes at both ends, so byte order does not matter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from chassis.core.attention import AttentionMetadata, ForwardContext


@dataclass(frozen=True)
class PackedLayout:
    """Where each array lies in the flat int32 tensor (offsets in int32 words)."""

    num_reqs: int
    num_tokens: int
    num_groups: int
    table_width: int

    @property
    def slots_start(self) -> int:
        """First word of the slot mappings: past query_start_loc and seq_lens, made even."""
        end = 2 * self.num_reqs + 1
        return end + (end % 2)

    @property
    def tables_start(self) -> int:
        return self.slots_start + 2 * self.num_groups * self.num_tokens

    @property
    def size(self) -> int:
        """Words in all."""
        return self.tables_start + self.num_groups * self.num_reqs * self.table_width


@dataclass
class StepArrays:
    """A step's metadata arrays as views of one packed tensor."""

    #: [R + 1] int32
    query_start_loc: torch.Tensor
    #: [R] int32
    seq_lens: torch.Tensor
    #: per group, [T] int64
    slot_mappings: list[torch.Tensor]
    #: per group, [R, B] int32
    block_tables: list[torch.Tensor]


def pack_step_metadata(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    slot_mappings: np.ndarray,
    block_tables: np.ndarray,
    pin_memory: bool = False,
) -> tuple[torch.Tensor, PackedLayout]:
    """The step's arrays in one flat int32 host tensor (pinned when ``pin_memory``).

    :param query_start_loc: ``[R + 1]`` cumulative query lengths
    :param seq_lens: ``[R]`` context lengths including the step's tokens
    :param slot_mappings: ``[G, T]`` every group's slot of each token (int64 values)
    :param block_tables: ``[G, R, B]`` every group's block table of each request (int32
        values)
    :return: the tensor and its :class:`PackedLayout`
    :raises ValueError: the shapes disagree
    """
    num_reqs = len(seq_lens)
    if slot_mappings.ndim != 2 or block_tables.ndim != 3:
        raise ValueError(
            f"slot mappings must be [groups, tokens] and block tables [groups, requests, "
            f"entries]; got {slot_mappings.shape} and {block_tables.shape}"
        )
    num_groups, num_tokens = slot_mappings.shape
    if len(query_start_loc) != num_reqs + 1 or block_tables.shape[:2] != (num_groups, num_reqs):
        raise ValueError(
            f"{num_reqs} requests and {num_groups} groups, but query_start_loc has "
            f"{len(query_start_loc)} entries and the block tables shape {block_tables.shape}"
        )
    layout = PackedLayout(num_reqs, num_tokens, num_groups, block_tables.shape[2])
    packed = torch.empty(layout.size, dtype=torch.int32, pin_memory=pin_memory)
    words = packed.numpy()
    words[: num_reqs + 1] = query_start_loc
    words[num_reqs + 1 : 2 * num_reqs + 1] = seq_lens
    slots_end = layout.tables_start
    words[layout.slots_start : slots_end].view(np.int64)[:] = slot_mappings.reshape(-1)
    words[slots_end:] = block_tables.reshape(-1)
    return packed, layout


def copy_packed(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``packed`` on ``device``: itself when it is there, else one non-blocking copy.

    Safe to issue non-blocking from pinned memory because :func:`pack_step_metadata` makes a
    new host tensor for every step, never a buffer the next step overwrites: torch's pinned
    allocator does not hand its memory out again before the copy recorded on it finished."""
    return packed if packed.device == device else packed.to(device, non_blocking=True)


def unpack_step_metadata(packed: torch.Tensor, layout: PackedLayout) -> StepArrays:
    """Views of ``packed`` (a copy of :func:`pack_step_metadata`'s tensor, on any device)."""
    r, t, g = layout.num_reqs, layout.num_tokens, layout.num_groups
    slots = packed[layout.slots_start : layout.tables_start].view(torch.int64).view(g, t)
    tables = packed[layout.tables_start : layout.size].view(g, r, layout.table_width)
    return StepArrays(
        query_start_loc=packed[: r + 1],
        seq_lens=packed[r + 1 : 2 * r + 1],
        slot_mappings=list(slots),
        block_tables=list(tables),
    )


def packed_forward_context(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    slot_mappings: np.ndarray,
    block_tables: np.ndarray,
    max_query_len: int,
    copy: Callable[[torch.Tensor], torch.Tensor],
    kv_caches: list[torch.Tensor],
    layer_group: list[int] | None,
    pin_memory: bool = False,
) -> ForwardContext:
    """The step's :class:`ForwardContext`, its device arrays from one call of ``copy``.

    Arguments as :func:`pack_step_metadata`'s; ``copy`` takes the packed host tensor to the
    device (the identity when the device is the host). ``layer_group`` maps attention layers
    to groups (None: one group, and ``group_metadata`` stays None). Equal, array by array, to
    ``step_forward_context`` with a copy per array.
    """
    packed, layout = pack_step_metadata(
        query_start_loc, seq_lens, slot_mappings, block_tables, pin_memory
    )
    arrays = unpack_step_metadata(copy(packed), layout)
    first = AttentionMetadata(
        num_actual_tokens=layout.num_tokens,
        num_reqs=layout.num_reqs,
        query_start_loc=arrays.query_start_loc,
        seq_lens=arrays.seq_lens,
        block_table=arrays.block_tables[0],
        slot_mapping=arrays.slot_mappings[0],
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=torch.from_numpy(query_start_loc),
        seq_lens_cpu=torch.from_numpy(seq_lens),
    )
    if layer_group is None:
        return ForwardContext(attn_metadata=first, kv_caches=kv_caches)
    group_metadata = [first]
    for table, slots in zip(arrays.block_tables[1:], arrays.slot_mappings[1:], strict=True):
        # (a backend's memo, ``derived``, is per block table)
        group_metadata.append(
            dataclasses.replace(first, block_table=table, slot_mapping=slots, derived={})
        )
    return ForwardContext(
        attn_metadata=first,
        kv_caches=kv_caches,
        group_metadata=group_metadata,
        layer_group=layer_group,
    )
