"""The model runner's persistent batch: per-request rows updated incrementally each step.

Rows live in preallocated host arrays (token ids, block tables, progress). A step only adds
new requests, appends new blocks and sampled tokens, nulls the block-table entries a sliding
window released since the last step, and removes finished ones by moving the last row into
the hole, so nothing is rebuilt from scratch.

Block tables: one per KV cache group (``KVCacheManager.num_groups``), each
``[max_num_reqs, max_blocks_per_req]``; block-id arguments are lists with one list per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from chassis.core.block_pool import NULL_BLOCK_ID
from chassis.core.logits_processor import AddedRequest, BatchUpdateBuilder
from chassis.core.sampling_metadata import SamplingRow
from chassis.core.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps per request besides the array rows."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    #: the request's LoRA adapter id (0: the base model)
    lora_int_id: int = 0
    #: a custom logits processor that reads generated tokens acts on this request
    processors_read_output: bool = False
    #: what the sampler reads; shares the token lists, so appended tokens show up in it
    sampling_row: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow(
            sampling_params=self.sampling_params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            generator=self.generator,
            eos_token_ids=self.eos_token_ids,
            processors_read_output=self.processors_read_output,
        )


class InputBatch:
    """Rows ``0 .. num_reqs-1`` hold the requests currently in the runner.

    ``num_kv_groups``: how many block tables each row has (one per KV cache group).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        num_kv_groups: int = 1,
    ) -> None:
        if num_kv_groups < 1:
            raise ValueError(f"num_kv_groups must be >= 1; got {num_kv_groups}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        #: tokens sampled by steps whose ids have not reached the host yet (async scheduling);
        #: ``token_ids`` holds the ``num_tokens`` known ones
        self.num_unresolved = np.zeros(max_num_reqs, dtype=np.int64)
        #: ``[group, row, entry]``: every KV cache group's block table in one array, so a
        #: step reads all groups' slots and tables with one indexing each
        self.group_block_table = np.zeros(
            (num_kv_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32
        )
        #: one block table per KV cache group (views of ``group_block_table``)
        self.block_tables = list(self.group_block_table)
        #: ``[group, row]``: entries in use in each block table
        self.group_num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        #: ``[group, row]``: leading entries already pointed at the null block
        self.group_num_null = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        #: each row's LoRA adapter id (0: the base model)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)
        self.request_ids: list[str] = []
        self.states: list[RequestState] = []
        self.row_of: dict[str, int] = {}
        #: records adds, removals and moves for custom logits processors (the runner sets it
        #: when ``--logits-processors`` names some); None: nobody listens
        self.updates: BatchUpdateBuilder | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_kv_groups(self) -> int:
        return len(self.block_tables)

    @property
    def block_table(self) -> np.ndarray:
        """Group 0's block table (the only one with one KV cache group)."""
        return self.block_tables[0]

    @property
    def num_blocks(self) -> np.ndarray:
        """Group 0's entries in use per row (a view: writes go through)."""
        return self.group_num_blocks[0]

    def add(
        self,
        state: RequestState,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_null_blocks: Sequence[int] = (),
    ) -> None:
        """Put a request in the next row: ``block_ids`` is its block table per KV cache
        group, whose first ``num_null_blocks[g]`` entries are the null block (empty: none)."""
        if state.request_id in self.row_of:
            raise ValueError(f"request {state.request_id!r} is already in the batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"the batch is full ({self.max_num_reqs} requests)")
        row = self.num_reqs
        tokens = state.prompt_token_ids + state.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(
                f"request {state.request_id!r} has {len(tokens)} tokens, more than "
                f"max_model_len {self.max_model_len}"
            )
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_unresolved[row] = 0
        self.group_num_blocks[:, row] = 0
        self.group_num_null[:, row] = 0
        self.lora_ids[row] = state.lora_int_id
        self.request_ids.append(state.request_id)
        self.states.append(state)
        self.row_of[state.request_id] = row
        self.append_blocks(row, block_ids)
        for group, num_null in enumerate(num_null_blocks):
            self.group_num_null[group, row] = num_null  # (add wrote those entries already)
        if self.updates is not None:
            self.updates.add(
                AddedRequest(
                    row, state.sampling_params, state.prompt_token_ids, state.output_token_ids
                )
            )

    def append_blocks(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Append ``block_ids[g]`` to the row's block table of group ``g``."""
        if len(block_ids) > self.num_kv_groups:
            raise ValueError(
                f"block ids for {len(block_ids)} KV cache groups; the batch has "
                f"{self.num_kv_groups}"
            )
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            table = self.block_tables[group]
            start = int(self.group_num_blocks[group, row])
            end = start + len(ids)
            if end > table.shape[1]:
                raise ValueError(
                    f"request {self.request_ids[row]!r} needs {end} blocks, more than "
                    f"{table.shape[1]} (max_model_len / block_size)"
                )
            table[row, start:end] = ids
            self.group_num_blocks[group, row] = end

    def null_leading_blocks(self, row: int, num_null_blocks: Sequence[int]) -> None:
        """Point the row's first ``num_null_blocks[g]`` entries of group ``g``'s block table at
        the null block (blocks the scheduler released: no layer of the group's window reads
        them any more). Only the entries past those already nulled are written, so a step
        costs what its window released, not the request's length."""
        for group, num_null in enumerate(num_null_blocks):
            if not num_null:
                continue  # (most steps and groups: nothing released, no array read)
            done = int(self.group_num_null[group, row])
            if num_null > done:
                self.block_tables[group][row, done:num_null] = NULL_BLOCK_ID
                self.group_num_null[group, row] = num_null

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.states[row].output_token_ids.append(token_id)

    def remove(self, request_id: str) -> None:
        """Drop a request, moving the last row into its place."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        if row != last:
            moved_id = self.request_ids[last]
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_tokens[row] = self.num_tokens[last]
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            self.num_unresolved[row] = self.num_unresolved[last]
            for group, table in enumerate(self.block_tables):
                nb = int(self.group_num_blocks[group, last])
                table[row, :nb] = table[last, :nb]
            self.group_num_blocks[:, row] = self.group_num_blocks[:, last]
            self.group_num_null[:, row] = self.group_num_null[:, last]
            self.lora_ids[row] = self.lora_ids[last]
            self.request_ids[row] = moved_id
            self.states[row] = self.states[last]
            self.row_of[moved_id] = row
        self.request_ids.pop()
        self.states.pop()
        if self.updates is not None:
            self.updates.remove(row, last if row != last else None)
