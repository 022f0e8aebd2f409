"""Draft-model proposals for speculative decoding (``--speculative-config`` method
``draft_model``, e.g. ``{"model": "path/to/small-model", "num_speculative_tokens": 4}``).

A small model with the target's vocabulary guesses the next ``k`` tokens of each request;
the target verifies them in its next step exactly as it verifies n-gram drafts
(:mod:`chassis.core.speculative`). The draft model lives in the worker beside the target:

- **KV cache.** One cache tensor per draft attention layer, addressed by the *same* block
  ids, block tables and slot mapping as the target's (no second block manager): a KV block
  holds a span of positions in both models, so a block costs the target's bytes plus the
  draft's (:meth:`DraftModelProposer.kv_cache_bytes_per_block`, which the block-count
  sizing adds). Prefix-cache hits therefore carry the draft's K/V too.
- **Invariant.** After every step, for each request, the draft's K/V are valid at every
  position the target's are (``num_computed_tokens``): :meth:`DraftModelProposer.propose`
  runs the draft over exactly the positions the step computed and kept (rejected drafts'
  positions are left, like the target's, to be overwritten later).
- **Proposal.** For a request that sampled this step and may speculate
  (:func:`~chassis.core.speculative.can_speculate`), that same first forward also feeds its
  newest token (at position ``q = num_computed_tokens``); the draft's argmax there is draft 1.
  Then ``k - 1`` single-token forwards feed draft ``j`` at ``q + j`` for draft ``j + 1``.
  The draft thus writes K/V at ``q .. q + k - 1``: the scheduler reserves those slots (a
  lookahead of ``k`` beyond the step's tokens), and a request whose blocks do not reach
  that far drafts fewer tokens. Greedy drafts are enough: verification by exact match keeps
  the target's output distribution whatever the drafts are.

The draft runs eager (no graphs, no torch.compile): ``k`` small forwards per step.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chassis.core.attention import ForwardContext, kv_cache_shape
from chassis.core.model_loader import kv_head_count
from chassis.core.model_runner import dummy_prefill, host_to_device, step_attention_metadata
from chassis.core.speculative import can_speculate

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.config import EngineConfig
    from chassis.core.input_batch import InputBatch
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)


def load_draft_model(
    config: EngineConfig,
    target_hf_config: Any,
    attention_backend_cls: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Build and fill the draft model of ``config.speculative`` (method ``draft_model``) on
    ``device`` in the target's ``dtype``.

    ``ValueError`` when its vocabulary size differs from the target's (its token ids would
    mean other tokens), when its context is shorter than ``max_model_len``, or when it cannot
    be read (unknown architecture, missing weights).
    """
    from chassis.core.model_loader import (
        build_model,
        load_hf_config,
        model_max_len,
        resolve_model_path,
    )
    from chassis.core.quantized_weights import check_quantization

    spec = config.speculative
    if spec is None or not spec.uses_draft_model or spec.model is None:
        raise ValueError("load_draft_model needs --speculative-config method 'draft_model'")
    path = resolve_model_path(spec.model)
    hf_config = load_hf_config(path)
    target_vocab, draft_vocab = int(target_hf_config.vocab_size), int(hf_config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens and the "
            f"target {target_vocab}: a draft model must share the target's tokenizer and "
            "vocabulary (pick a smaller model of the same family)"
        )
    assert config.max_model_len is not None  # set by finalize_config
    if model_max_len(hf_config) < config.max_model_len:
        raise ValueError(
            f"the draft model {spec.model!r} has a context of {model_max_len(hf_config)} "
            f"tokens, shorter than --max-model-len {config.max_model_len}; lower "
            "--max-model-len or use another draft model"
        )
    check_quantization(hf_config)
    model = build_model(config, hf_config, path, attention_backend_cls, device, dtype)
    logger.info(
        "draft model %s loaded: %d layers, %d drafts per step",
        spec.model,
        model.num_attention_layers,
        spec.num_speculative_tokens,
    )
    return model


class DraftModelProposer:
    """The draft model, its KV caches and the proposal of each step's drafts.

    ``kv_dtype`` is the dtype of the target's cache (the draft's is the same). Call
    :meth:`initialize_kv_cache` with the target's block count before :meth:`propose`.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        device: torch.device,
        kv_dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        spec = config.speculative
        assert spec is not None and config.max_model_len is not None
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype
        self.pin_memory = pin_memory
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        hf = model.hf_config
        self.vocab_size = int(hf.vocab_size)
        self.num_kv_heads = kv_head_count(hf)
        self.head_dim = int(
            getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        )
        self.kv_caches: list[torch.Tensor] = []

    # -- KV cache -------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes the draft's layers add to one KV block (K and V, all draft layers)."""
        per_layer = math.prod(kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim))
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return per_layer * elem * self.model.num_attention_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one cache per draft layer with the target's ``num_blocks`` blocks."""
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.model.num_attention_layers)
        ]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One draft forward over ``num_tokens`` dummy tokens (split into requests of at
        most ``max_model_len``) without a KV cache write, and logits for ``max_num_seqs``
        rows: the draft's activation peak, for the memory profile."""
        num_tokens = max(1, num_tokens)
        input_ids, positions, ctx = dummy_prefill(
            num_tokens,
            self.max_model_len,
            self.block_size,
            self.model.num_attention_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_dtype,
            self.device,
            self._to_device,
        )
        hidden = self.model(input_ids, positions, ctx)
        self.model.compute_logits(hidden[: min(self.max_num_seqs, num_tokens)])

    # -- proposing ------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        sampled: np.ndarray,
    ) -> dict[str, list[int]]:
        """Run the draft over the step just executed and propose the next step's drafts.

        Call once the step is resolved (``batch`` holds its accepted tokens and
        ``num_computed_tokens``). ``rows`` are the step's scheduled batch rows, ``starts``
        each one's first position in the step, ``sampled`` whether it got tokens. Returns
        request id -> up to ``num_speculative_tokens`` greedy drafts (none for a request
        that may not speculate, is done, or has no reserved slots left).
        """
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        room = self._room(batch, rows, computed, sampled)
        drafting = room > 0
        # The positions the step computed and kept, plus a drafting request's newest token.
        query_lens = computed + drafting - starts
        hidden = self._forward(batch, rows, starts, query_lens)
        if not drafting.any():
            return {}
        index = np.nonzero(drafting)[0]  # the drafting requests, by position in rows
        need = room[index]
        last_token = np.cumsum(query_lens)[index] - 1
        tokens = self._argmax(hidden[self._to_device(last_token)])
        drafts = [[t] for t in tokens]
        alive = np.arange(len(index))  # those still drafting, by position in index
        for j in range(1, int(need.max())):
            keep = need[alive] > j
            alive = alive[keep]
            rows_j = rows[index[alive]]
            tokens = self._argmax(
                self._forward(
                    batch,
                    rows_j,
                    computed[index[alive]] + j,  # draft j goes at q + j
                    np.ones(len(alive), dtype=np.int64),
                    input_ids=np.array(tokens, dtype=np.int64)[keep],
                )
            )
            for a, token in zip(alive.tolist(), tokens, strict=True):
                drafts[a].append(token)
        return {batch.request_ids[rows[i]]: drafts[a] for a, i in enumerate(index.tolist())}

    def _room(
        self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray, sampled: np.ndarray
    ) -> np.ndarray:
        """Per row, how many drafts to propose: 0 unless it sampled and may speculate; at
        most ``k``, the slots its blocks reserve from its newest token's position on, and
        what ``max_tokens`` and the context leave for a verify step."""
        room = np.zeros(len(rows), dtype=np.int64)
        k = self.num_speculative_tokens
        for i, r in enumerate(rows):
            if not sampled[i]:
                continue
            state = batch.states[r]
            params = state.sampling_params
            num_output = len(state.output_token_ids)
            if not can_speculate(params, num_output):
                continue
            newest = state.output_token_ids[-1] if state.output_token_ids else None
            if newest in params.stop_token_ids or (
                newest in state.eos_token_ids and not params.ignore_eos
            ):
                continue  # it stops here
            q = int(computed[i])  # the newest token's position
            m = min(k, int(batch.num_blocks[r]) * self.block_size - q, self.max_model_len - q - 2)
            if params.max_tokens is not None:
                m = min(m, params.max_tokens - num_output - 1)
            room[i] = max(m, 0)
        return room

    def _forward(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        query_lens: np.ndarray,
        input_ids: np.ndarray | None = None,
    ) -> torch.Tensor:
        """The draft's hidden states for ``query_lens[i]`` tokens of each of ``rows`` from
        position ``starts[i]``, writing their K/V at the rows' slots. The tokens are the
        batch's, or ``input_ids`` (one per token) for the single-token steps."""
        total = int(query_lens.sum())
        cu = np.cumsum(query_lens)
        query_start_loc = np.concatenate(([0], cu)).astype(np.int32)
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)
        positions = starts[req_of_token] + (np.arange(total) - query_start_loc[:-1][req_of_token])
        token_rows = rows[req_of_token]
        if input_ids is None:
            input_ids = batch.token_ids[token_rows, positions]
        block_size = self.block_size
        block_ids = batch.block_table[token_rows, positions // block_size].astype(np.int64)
        slot_mapping = block_ids * block_size + positions % block_size
        seq_lens = (starts + query_lens).astype(np.int32)
        max_blocks = math.ceil(int(seq_lens.max()) / block_size)
        block_table = np.ascontiguousarray(batch.block_table[rows, :max_blocks])
        metadata = step_attention_metadata(
            query_start_loc,
            seq_lens,
            block_table,
            slot_mapping,
            int(query_lens.max()),
            self._to_device,
        )
        ctx = ForwardContext(attn_metadata=metadata, kv_caches=self.kv_caches)
        return self.model(self._to_device(input_ids), self._to_device(positions), ctx)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """The draft's greedy token after each row of ``hidden``."""
        return self.model.compute_logits(hidden)[:, : self.vocab_size].argmax(dim=-1).tolist()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device, self.pin_memory)
