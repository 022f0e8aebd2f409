"""KV cache groups: one block table per group of attention layers (docs/architecture.md,
"KV cache per group of layers").

The runner side: ``InputBatch`` keeps a block table per group and nulls only the entries a
window released since the last step; ``step_forward_context`` gives each layer its group's
metadata through ``ForwardContext.metadata_for``.
"""

from __future__ import annotations

import numpy as np
import torch

from chassis.core.block_pool import NULL_BLOCK_ID
from chassis.core.input_batch import InputBatch, RequestState
from chassis.core.model_runner import group_slots_and_tables, step_forward_context
from chassis.core.sampling_params import SamplingParams


def _state(request_id: str) -> RequestState:
    return RequestState(request_id, [1, 2, 3], [], SamplingParams(), frozenset(), None)


def test_the_batch_keeps_one_block_table_per_group_and_moves_them_with_rows() -> None:
    batch = InputBatch(max_num_reqs=3, max_model_len=32, max_blocks_per_req=8, num_kv_groups=2)
    batch.add(_state("a"), [[5, 6], [7]], 0)
    batch.add(_state("b"), [[NULL_BLOCK_ID, 9, 10], [11]], 8, num_null_blocks=[1, 0])
    batch.append_blocks(1, [[12], []])
    assert batch.block_tables[0][1, :4].tolist() == [NULL_BLOCK_ID, 9, 10, 12]
    assert batch.group_num_blocks[:, 1].tolist() == [4, 1]
    assert batch.group_num_null[:, 1].tolist() == [1, 0]
    batch.remove("a")  # b moves to row 0 with both tables and counts
    assert batch.row_of == {"b": 0}
    assert batch.block_tables[0][0, :4].tolist() == [NULL_BLOCK_ID, 9, 10, 12]
    assert batch.block_tables[1][0, :1].tolist() == [11]
    assert batch.group_num_blocks[:, 0].tolist() == [4, 1]
    assert batch.group_num_null[:, 0].tolist() == [1, 0]
    # group 0's aliases (what the draft model and single-group code read)
    assert batch.block_table is batch.block_tables[0]
    assert int(batch.num_blocks[0]) == 4


def test_nulling_writes_only_the_entries_released_since_the_last_step() -> None:
    batch = InputBatch(max_num_reqs=1, max_model_len=32, max_blocks_per_req=8, num_kv_groups=2)
    batch.add(_state("a"), [[3, 4, 5, 6], [7, 8]], 0)
    batch.null_leading_blocks(0, [2, 0])
    assert batch.block_tables[0][0, :4].tolist() == [NULL_BLOCK_ID, NULL_BLOCK_ID, 5, 6]
    # an entry already applied is not written again: a marker there survives the next step
    batch.block_tables[0][0, 0] = 99
    batch.null_leading_blocks(0, [3, 1])
    assert batch.block_tables[0][0, :4].tolist() == [99, NULL_BLOCK_ID, NULL_BLOCK_ID, 6]
    assert batch.block_tables[1][0, :2].tolist() == [NULL_BLOCK_ID, 8]
    batch.null_leading_blocks(0, [3, 1])  # the same counts again: nothing to do
    assert batch.block_tables[0][0, 0] == 99


def test_each_layer_reads_its_groups_block_table_and_slots() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=4, num_kv_groups=2)
    batch.add(_state("a"), [[1, 2], [3, 4]], 0)
    rows = np.array([0])
    positions = np.array([4, 5])
    slots, tables = group_slots_and_tables(batch, rows, np.array([0, 0]), positions, 6, 4)
    assert [s.tolist() for s in slots] == [[8, 9], [16, 17]]  # block 2 / block 4, offsets 0, 1
    assert [t.tolist() for t in tables] == [[[1, 2]], [[3, 4]]]
    ctx = step_forward_context(
        np.array([0, 2], dtype=np.int32),
        np.array([6], dtype=np.int32),
        tables,
        slots,
        2,
        torch.from_numpy,
        [torch.zeros(1)] * 3,
        layer_group=[0, 1, 0],
    )
    assert ctx.metadata_for(0) is ctx.metadata_for(2) is ctx.attn_metadata
    assert ctx.metadata_for(1).block_table.tolist() == [[3, 4]]
    assert ctx.metadata_for(1).slot_mapping.tolist() == [16, 17]
    assert ctx.metadata_for(1).seq_lens is ctx.attn_metadata.seq_lens  # shared
    one = step_forward_context(
        np.array([0, 2], dtype=np.int32),
        np.array([6], dtype=np.int32),
        tables[:1],
        slots[:1],
        2,
        torch.from_numpy,
        [torch.zeros(1)],
        layer_group=None,
    )
    assert one.group_metadata is None and one.metadata_for(0) is one.attn_metadata
