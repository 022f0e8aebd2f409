"""KV cache groups: one block table per group of attention layers (docs/architecture.md,
"KV cache per group of layers").

The runner side: ``InputBatch`` keeps a block table per group and nulls only the entries a
window released since the last step; ``step_forward_context`` gives each layer its group's
metadata through ``ForwardContext.metadata_for``; ``packed_forward_context`` (what the runner
calls) makes the same metadata with one host-to-device copy for every group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chassis.core.attention import ForwardContext
from chassis.core.block_pool import NULL_BLOCK_ID
from chassis.core.cuda_graphs import DecodeGraphs
from chassis.core.input_batch import InputBatch, RequestState
from chassis.core.model_runner import group_slots_and_tables, step_forward_context
from chassis.core.packed_step_metadata import (
    copy_packed,
    pack_step_metadata,
    packed_forward_context,
)
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


class _GroupEchoModel(torch.nn.Module):
    """Hidden state of token t = [layer 0's slot, layer 1's slot, their block 0s]."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        first, second = ctx.metadata_for(0), ctx.metadata_for(1)
        assert first.seq_lens.data_ptr() == second.seq_lens.data_ptr()  # one shared buffer
        cols = [
            first.slot_mapping,
            second.slot_mapping,
            first.block_table[:, 0].long(),
            second.block_table[:, 0].long(),
        ]
        return torch.stack(cols, dim=1).float()


def test_decode_graphs_replay_each_groups_slots_and_tables() -> None:
    from test_cuda_graphs import GraphTestPlatform

    graphs = DecodeGraphs(
        _GroupEchoModel(),
        [],
        GraphTestPlatform(),
        [2, 4],
        device=torch.device("cpu"),
        max_model_len=64,
        max_blocks_per_req=4,
        layer_group=[1, 0],  # layer 0 reads group 1, layer 1 group 0
    )
    graphs.capture()
    n = 3
    slots = [np.array([5, 6, 7]), np.array([50, 60, 70])]
    tables = [np.array([[1], [2], [3]], np.int32), np.array([[11], [12], [13]], np.int32)]
    with torch.inference_mode():
        out = graphs.run(
            np.zeros(n, np.int64), np.zeros(n, np.int64), slots, np.ones(n, np.int32), tables
        )
    expected = np.stack([slots[1], slots[0], tables[1][:, 0], tables[0][:, 0]], axis=1)
    np.testing.assert_array_equal(out.numpy(), expected)
    assert (graphs._inputs.slot_mappings[1][n:4] == -1).all()  # padding writes nothing
    with pytest.raises(ValueError, match="captured for 2"):
        graphs.run(
            np.zeros(n, np.int64), np.zeros(n, np.int64), slots[0], np.ones(n, np.int32), tables[0]
        )


class _CountingCopy:
    """A stand-in for the host-to-device copy: clones (so the results are not views of the
    host arrays) and records what it was handed."""

    def __init__(self) -> None:
        self.handed: list[torch.Tensor] = []

    def __call__(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
        self.handed.append(tensor)
        return tensor.clone()


def _random_batch(num_groups: int, seed: int) -> tuple[InputBatch, np.ndarray, np.ndarray]:
    """A batch of 3..6 requests with random block tables per group, the rows of a step (a
    random subset, in row order) and their context lengths."""
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(3, 7))
    batch = InputBatch(num_reqs, 64, 16, num_kv_groups=num_groups)
    for i in range(num_reqs):
        num_blocks = int(rng.integers(1, 9))
        tables = [rng.integers(1, 500, num_blocks).tolist() for _ in range(num_groups)]
        batch.add(_state(f"r{i}"), tables, 0)
    rows = np.sort(rng.choice(num_reqs, int(rng.integers(1, num_reqs + 1)), replace=False))
    seq_lens = np.minimum(batch.group_num_blocks[0, rows], 4) * 4
    return batch, rows, seq_lens


@pytest.mark.parametrize("num_groups", [1, 2, 3, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_packed_copy_equals_a_copy_per_array(num_groups: int, seed: int) -> None:
    """The runner's path (one copy of one packed tensor) against the reference (a copy per
    array): the same metadata for every group, and the device tables equal the host ones."""
    batch, rows, seq_lens = _random_batch(num_groups, seed)
    num_scheduled = np.maximum(seq_lens // 3, 1)
    starts = seq_lens - num_scheduled
    query_start_loc = np.concatenate(([0], np.cumsum(num_scheduled))).astype(np.int32)
    req_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
    positions = starts[req_of_token] + (
        np.arange(int(num_scheduled.sum())) - query_start_loc[:-1][req_of_token]
    )
    slots, tables = group_slots_and_tables(
        batch, rows, rows[req_of_token], positions, int(seq_lens.max()), 4
    )
    seq_lens_i32 = seq_lens.astype(np.int32)
    layer_group = None if num_groups == 1 else list(range(num_groups))
    caches = [torch.zeros(1)] * num_groups
    per_array, packed = _CountingCopy(), _CountingCopy()
    args = (query_start_loc, seq_lens_i32)
    reference = step_forward_context(
        *args, tables, slots, 3, per_array, caches, layer_group=layer_group
    )
    fast = packed_forward_context(*args, slots, tables, 3, packed, caches, layer_group)
    assert len(per_array.handed) == 2 + 2 * num_groups
    assert len(packed.handed) == 1 and packed.handed[0].dim() == 1  # one flat tensor
    for layer in range(num_groups):
        want, got = reference.metadata_for(layer), fast.metadata_for(layer)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len"):
            assert getattr(got, name) == getattr(want, name), name
        assert torch.equal(got.query_start_loc_cpu, want.query_start_loc_cpu)
        # the stacked device table of the layer's group is the batch's host table
        width = got.block_table.shape[1]
        np.testing.assert_array_equal(
            got.block_table.numpy(), batch.block_tables[layer][rows, :width]
        )
    assert (fast.group_metadata is None) == (num_groups == 1)


def test_packing_refuses_shapes_that_disagree() -> None:
    qsl, lens = np.array([0, 1, 2], np.int32), np.array([1, 1], np.int32)
    with pytest.raises(ValueError, match="groups, tokens"):
        pack_step_metadata(qsl, lens, np.zeros(2, np.int64), np.zeros((1, 2, 1), np.int32))
    with pytest.raises(ValueError, match="2 requests and 2 groups"):
        pack_step_metadata(qsl, lens, np.zeros((2, 2), np.int64), np.zeros((1, 2, 1), np.int32))


def test_each_step_packs_into_a_new_host_tensor() -> None:
    """The packed tensor goes to the device by a non-blocking copy: a host buffer reused by
    the next step could be overwritten before that copy ran. Each call packs into its own
    tensor (the earlier one keeps its values), and on the host no copy is made."""
    qsl, lens = np.array([0, 1, 2], np.int32), np.array([1, 1], np.int32)
    tables = np.zeros((2, 2, 1), np.int32)
    first, _ = pack_step_metadata(qsl, lens, np.full((2, 2), 5, np.int64), tables)
    kept = first.clone()
    second, _ = pack_step_metadata(qsl, lens, np.full((2, 2), 9, np.int64), tables)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept)
    assert copy_packed(first, torch.device("cpu")) is first


@pytest.mark.parametrize("packed_tables", [True, False])
def test_decode_graph_replay_fills_every_input_in_one_copy(
    packed_tables: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay stages ids, positions, every group's slots, the context lengths and (when
    small) every group's block tables in one host mirror of the static buffers and copies it
    in one piece; tables above ``MAX_PACKED_TABLE_BYTES`` go in a second copy of the step's
    columns only, from a contiguous host array (a strided one would be pinned, then copied
    again to pageable memory by the device copy). Replays alternate between two mirrors."""
    from test_cuda_graphs import GraphTestPlatform

    from chassis.core import cuda_graphs

    if not packed_tables:
        monkeypatch.setattr(cuda_graphs, "MAX_PACKED_TABLE_BYTES", 0)
    graphs = DecodeGraphs(
        _GroupEchoModel(),
        [],
        GraphTestPlatform(),
        [2, 4],
        device=torch.device("cpu"),
        max_model_len=64,
        max_blocks_per_req=4,
        layer_group=[1, 0],
    )
    graphs.capture()
    staged: list[np.ndarray] = []
    host = graphs._host

    def recording(array: np.ndarray) -> torch.Tensor:
        staged.append(array)
        return host(array)

    graphs._host = recording  # type: ignore[method-assign]
    mirrors = []
    for value in (5, 7):
        slots = [np.array([value]), np.array([10 * value])]
        tables = [np.array([[value + 1]], np.int32), np.array([[value + 11]], np.int32)]
        with torch.inference_mode():
            out = graphs.run(
                np.zeros(1, np.int64), np.zeros(1, np.int64), slots, np.ones(1, np.int32), tables
            )
        np.testing.assert_array_equal(out.numpy(), [[10 * value, value, value + 11, value + 1]])
        mirrors.append(graphs._staging.turn)
        assert (graphs._inputs.slot_mappings[0][1:2] == -1).all()  # padding writes nothing
    assert mirrors[0] != mirrors[1]
    if packed_tables:
        assert staged == []
    else:
        assert len(staged) == 2 and all(a.flags.c_contiguous for a in staged)
