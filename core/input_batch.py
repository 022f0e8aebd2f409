"""The model runner's persistent batch: per-request rows updated incrementally each step.

Rows live in preallocated host arrays (token ids, block tables, progress). A step only adds
new requests, appends new blocks and sampled tokens, and removes finished ones by moving the
last row into the hole, so nothing is rebuilt from scratch.
"""

from __future__ import annotations

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
    """Rows ``0 .. num_reqs-1`` hold the requests currently in the runner."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        #: tokens sampled by steps whose ids have not reached the host yet (async scheduling);
        #: ``token_ids`` holds the ``num_tokens`` known ones
        self.num_unresolved = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
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

    def add(self, state: RequestState, block_ids: list[int], num_computed_tokens: int) -> None:
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
        self.num_blocks[row] = 0
        self.lora_ids[row] = state.lora_int_id
        self.request_ids.append(state.request_id)
        self.states.append(state)
        self.row_of[state.request_id] = row
        self.append_blocks(row, block_ids)
        if self.updates is not None:
            self.updates.add(
                AddedRequest(
                    row, state.sampling_params, state.prompt_token_ids, state.output_token_ids
                )
            )

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(
                f"request {self.request_ids[row]!r} needs {end} blocks, more than "
                f"{self.block_table.shape[1]} (max_model_len / block_size)"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def null_leading_blocks(self, row: int, num_null_blocks: int) -> None:
        """Point the row's first ``num_null_blocks`` block-table entries at the null block
        (blocks the scheduler released: no layer's window reads them any more)."""
        if num_null_blocks:
            self.block_table[row, :num_null_blocks] = NULL_BLOCK_ID

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
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_blocks[row] = nb
            self.lora_ids[row] = self.lora_ids[last]
            self.request_ids[row] = moved_id
            self.states[row] = self.states[last]
            self.row_of[moved_id] = row
        self.request_ids.pop()
        self.states.pop()
        if self.updates is not None:
            self.updates.remove(row, last if row != last else None)
