"""Draft-model proposals for speculative decoding (``--speculative-config`` method
``draft_model``, e.g. ``{"model": "path/to/small-model", "num_speculative_tokens": 4}``).

A small model with the target's vocabulary guesses the next ``k`` tokens of each request;
the target verifies them in its next step exactly as it verifies n-gram drafts
(:mod:`chassis.core.speculative`). The draft model lives in the worker beside the target:

- **KV cache.** Cache tensors of the draft's attention layers, addressed by the *same*
  block ids, block tables and slot mappings as the target's (no second block manager): a
  KV block holds a span of positions in both models, so a block costs the target's bytes
  plus the draft's (:meth:`DraftModelProposer.kv_cache_bytes_per_block`, which the
  block-count sizing adds). Prefix-cache hits therefore carry the draft's K/V too. When
  the target has KV cache groups (:mod:`chassis.core.kv_cache_groups`), each draft layer
  uses the table of a group that keeps what it reads
  (:func:`~chassis.core.kv_cache_groups.draft_layer_placement`), and draft layers of
  different groups share a tensor as the target's do: a block id names one group's slot,
  so a tensor per draft layer would leave the other groups' ids idle in it.
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
  that far drafts fewer tokens.
- **Which token.** Greedy requests and requests with their own ``seed`` (and every
  request with ``draft_sampling: "greedy"``, a sampler without
  :attr:`~chassis.core.sampler_interface.Sampler.provides_probabilities`, or custom logits
  processors) get the draft's argmax: a one-hot ``q``, which the runner's
  exact-match verification already rejection-samples exactly (and which keeps a seeded
  request's output plain decoding's: :mod:`chassis.core.seeded_drafts`). An unseeded
  random request's draft is *drawn* from the draft's own distribution ``q`` under the
  request's temperature, top-k, top-p and min-p (the runner's sampler computes it, :meth:`Sampler.probabilities`; the
  rest of the sampling parameters never apply to a request that may speculate). The
  proposer keeps ``q`` on the device until the target verifies those drafts by rejection
  sampling (:meth:`DraftModelProposer.verify`, :mod:`chassis.core.rejection_sampling`).

The draft runs eager (no graphs, no torch.compile): ``k`` small forwards per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chassis.core.attention import kv_cache_shape
from chassis.core.kv_cache_groups import KVCacheGroupSpec, draft_layer_placement
from chassis.core.model_loader import kv_head_count
from chassis.core.model_runner import (
    dummy_prefill,
    group_slots_and_tables,
    host_to_device,
    layer_windows,
)
from chassis.core.packed_step_metadata import copy_packed, packed_forward_context
from chassis.core.rejection_sampling import rejection_sample
from chassis.core.sampling_metadata import SAMPLING_EPS, SamplingRow, build_sampling_metadata
from chassis.core.sampling_params import SamplingParams
from chassis.core.speculative import can_speculate
from chassis.core.token_draw import exponential_race
from chassis.core.weights import checkpoint_tensor_names, has_weight_files

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend, ForwardContext
    from chassis.core.config import EngineConfig
    from chassis.core.input_batch import InputBatch, RequestState
    from chassis.core.model_interface import CausalLM
    from chassis.core.sampler_interface import Sampler
    from chassis.core.sampling_metadata import SamplingMetadata

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
    path = resolve_model_path(spec.model, load_format=config.load_format)
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
    names = checkpoint_tensor_names(path) if has_weight_files(path) else set()
    if "d2t" in names or any(n.startswith("midlayer.") for n in names):
        raise ValueError(
            f"the draft model {spec.model!r} is an EAGLE-3 head (it has midlayer.* or d2t "
            "tensors), not a model: pass --speculative-config method 'eagle3'"
        )
    if "fc.weight" in names:
        raise ValueError(
            f"the draft model {spec.model!r} is an EAGLE-1 head (it has fc.weight), not a "
            "model: pass --speculative-config method 'eagle'"
        )
    model = build_model(config, hf_config, path, attention_backend_cls, device, dtype)
    logger.info(
        "draft model %s loaded: %d layers, %d drafts per step, random requests' drafts %s "
        "(draft_sampling %s; greedy requests' drafts are always one-hot)",
        spec.model,
        model.num_attention_layers,
        spec.num_speculative_tokens,
        "drawn from the draft's distribution (probabilistic)"
        if spec.draft_sampling == "probabilistic"
        else "its argmax (one-hot)",
        spec.draft_sampling,
    )
    return model


#: the sampling row :meth:`DraftModelProposer.profile_verify` verifies with
_PROFILE_SAMPLING_ROW = SamplingRow(
    sampling_params=SamplingParams(temperature=1.0), prompt_token_ids=[0], output_token_ids=[]
)


@dataclass
class _DraftProbs:
    """The drafts last proposed for one request and the distributions they were drawn from."""

    token_ids: list[int]
    #: ``[rows, vocab]`` float32 on the device, the proposing step's q of every random
    #: request; row ``base + j`` is ``q`` of draft ``j``
    flat: torch.Tensor
    base: int


@dataclass
class VerifyRows:
    """The verify rows of one step whose drafts are probabilistic (see
    :meth:`DraftModelProposer.prepare_verify`)."""

    #: ``[rows]`` int64 on the device: their indices among the step's logits rows
    index: torch.Tensor
    #: ``[rows, vocab]`` float32: a copy of their logits, before the sampler edits them
    logits: torch.Tensor
    #: ``[rows, vocab]`` float32: ``q`` of the draft each row verifies (0 on bonus rows)
    draft_probs: torch.Tensor
    #: ``[rows]`` int64: the draft each row verifies (0 on bonus rows)
    draft_token_ids: torch.Tensor
    #: ``[rows]`` bool: the row after the request's last draft
    is_bonus: torch.Tensor
    #: the rows' sampling settings (for the target's ``p``)
    states: list[RequestState]


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
        #: with the target's KV cache groups: the group whose block table each draft layer
        #: reads (by layer number), and its cache tensor; None: group 0's, a tensor each
        self.layer_group: list[int] | None = None
        self._layer_tensor: list[int] | None = None
        #: the runner's sampler when it gives probabilities for probabilistic drafts (see
        #: :meth:`use_sampler`); None: every draft is the draft's argmax
        self.sampler: Sampler | None = None
        self._draft_sampling = spec.draft_sampling
        #: request id -> its last probabilistic drafts and their q (random requests only)
        self._draft_probs: dict[str, _DraftProbs] = {}

    def use_sampler(self, sampler: Sampler, has_logits_processors: bool) -> bool:
        """Draw random requests' drafts with ``sampler``'s distributions and verify them by
        rejection sampling, when ``draft_sampling`` is ``"probabilistic"``, the sampler
        :attr:`~Sampler.provides_probabilities` and no custom logits processors run (their
        effect on ``p`` is not computed here); else keep greedy drafts. Returns whether
        drafts are probabilistic."""
        probabilistic = (
            self._draft_sampling == "probabilistic"
            and sampler.provides_probabilities
            and not has_logits_processors
        )
        self.sampler = sampler if probabilistic else None
        if self._draft_sampling == "probabilistic" and not probabilistic:
            logger.info(
                "draft model proposes greedy drafts for every request: %s",
                "custom logits processors are on"
                if has_logits_processors
                else f"sampler {type(sampler).__qualname__} does not provide probabilities",
            )
        return probabilistic

    # -- KV cache -------------------------------------------------------------------------

    def place_on_groups(self, groups: list[KVCacheGroupSpec] | None) -> None:
        """Read the target's KV cache groups (None: one block table): each draft layer gets
        the group whose table it reads and a cache tensor
        (:func:`~chassis.core.kv_cache_groups.draft_layer_placement`). A draft whose
        attention layers this cannot see all read group 0's, a full-attention group. Call
        before :meth:`kv_cache_bytes_per_block`."""
        self.layer_group = self._layer_tensor = None
        if groups is None or len(groups) == 1:
            return
        windows = layer_windows(self.model)
        if windows is None:
            num_layers = self.model.num_attention_layers
            self.layer_group, self._layer_tensor = [0] * num_layers, list(range(num_layers))
            return
        self.layer_group, self._layer_tensor = draft_layer_placement(groups, windows)

    def num_cache_tensors(self) -> int:
        """The draft's cache tensors of ``num_blocks`` blocks: one per draft layer, or with
        the target's groups the most draft layers any one group holds."""
        if self._layer_tensor is None:
            return self.model.num_attention_layers
        return max(self._layer_tensor) + 1

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes the draft's layers add to one KV block id (K and V, every draft cache
        tensor)."""
        per_layer = math.prod(kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim))
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return per_layer * elem * self.num_cache_tensors()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's cache tensors with the target's ``num_blocks`` blocks (zeros
        from the current platform, as the target's); ``kv_caches`` lists one per draft
        layer (shared between layers of different groups)."""
        from chassis.platforms import get_current_platform

        platform = get_current_platform()
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        tensors = [
            platform.kv_cache_zeros(shape, self.kv_dtype, self.device)
            for _ in range(self.num_cache_tensors())
        ]
        self.kv_caches = (
            tensors if self._layer_tensor is None else [tensors[j] for j in self._layer_tensor]
        )

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One draft forward over ``num_tokens`` dummy tokens (split into requests of at
        most ``max_model_len``) without a KV cache write, and logits for ``max_num_seqs``
        rows: the draft's activation peak, for the memory profile. With probabilistic drafts
        the ``q`` of ``k`` drafts per request is held meanwhile (it stays between steps)."""
        num_tokens = max(1, num_tokens)
        kept_q = None
        if self.sampler is not None:
            rows = self.max_num_seqs * self.num_speculative_tokens
            kept_q = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
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
        hidden = self._profile_forward(input_ids, positions, ctx)
        self.model.compute_logits(hidden[: min(self.max_num_seqs, num_tokens)])
        del kept_q

    def _profile_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The model's forward in :meth:`profile_run` (a subclass whose model reads more
        inputs than the tokens adds dummy ones)."""
        return self.model(input_ids, positions, ctx)

    # -- proposing ------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        sampled: np.ndarray,
        target_hidden: torch.Tensor | None = None,
        query_start_loc: np.ndarray | None = None,
    ) -> dict[str, list[int]]:
        """Run the draft over the step just executed and propose the next step's drafts.

        Call once the step is resolved (``batch`` holds its accepted tokens and
        ``num_computed_tokens``). ``rows`` are the step's scheduled batch rows, ``starts``
        each one's first position in the step, ``sampled`` whether it got tokens;
        ``target_hidden`` (``[tokens of the step, hidden]``, the target's final hidden
        states in step order) and ``query_start_loc`` (``[len(rows) + 1]``: where each row's
        tokens start in it) are the step's, for a proposer that reads the target's states
        (:class:`~chassis.core.eagle.EagleProposer`; a draft model ignores them). Returns
        request id -> up to ``num_speculative_tokens`` drafts: the draft's argmax, or for a
        random request with probabilistic drafts a draw from its ``q``, kept for
        :meth:`prepare_verify` (none for a request that may not speculate, is done, or has
        no reserved slots left).
        """
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        room = self._room(batch, rows, computed, sampled)
        drafting = room > 0
        self._drop_stale_probs(batch)
        for r in rows[sampled]:  # their last drafts are verified: proposed anew below
            self._draft_probs.pop(batch.request_ids[r], None)
        # The positions the step computed and kept, plus a drafting request's newest token.
        query_lens = computed + drafting - starts
        hidden = self._forward(batch, rows, starts, query_lens)
        if not drafting.any():
            return {}
        index = np.nonzero(drafting)[0]  # the drafting requests, by position in rows
        last_token = np.cumsum(query_lens)[index] - 1

        def forward(
            j: int, alive: np.ndarray, keep: np.ndarray, tokens: np.ndarray, _: torch.Tensor
        ) -> torch.Tensor:
            return self._forward(
                batch,
                rows[index[alive]],
                computed[index[alive]] + j,  # draft j goes at q + j
                np.ones(len(alive), dtype=np.int64),
                input_ids=tokens,
            )

        return self._draft_rounds(
            [batch.states[r] for r in rows[index]],
            room[index],
            hidden[self._to_device(last_token)],
            forward,
        )

    def _draft_rounds(
        self,
        states: list[RequestState],
        need: np.ndarray,
        hidden: torch.Tensor,
        forward: Callable[[int, np.ndarray, np.ndarray, np.ndarray, torch.Tensor], torch.Tensor],
    ) -> dict[str, list[int]]:
        """Request id -> the drafts of ``states`` (request ``a`` gets ``need[a]``), draft
        step by draft step, keeping the ``q`` of probabilistic ones for
        :meth:`prepare_verify`. ``hidden``: the model's output that gives each request's
        draft 1; ``forward(j, alive, keep, tokens, hidden)``: its output that gives draft
        ``j + 1`` of the requests ``alive`` (by position in ``states``), fed their draft
        ``j`` ``tokens``, where ``keep`` picks them among the previous round's rows of
        ``hidden``."""
        choose = _DraftChooser(self, states, int(need.max()))
        alive = np.arange(len(states))  # those still drafting, by position in states
        tokens = choose(hidden, alive, 0)
        drafts = [[t] for t in tokens]
        for j in range(1, int(need.max())):
            keep = need[alive] > j
            alive = alive[keep]
            hidden = forward(j, alive, keep, np.array(tokens, dtype=np.int64)[keep], hidden)
            tokens = choose(hidden, alive, j)
            for a, token in zip(alive.tolist(), tokens, strict=True):
                drafts[a].append(token)
        for a, state in enumerate(states):
            entry = choose.probs_of(a, drafts[a])
            if entry is not None:
                self._draft_probs[state.request_id] = entry
        return {state.request_id: drafts[a] for a, state in enumerate(states)}

    def greedy_drafts(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64: the argmax of the draft's logits over the vocabulary for each row of
        ``hidden`` (draft hidden states), the greedy drafts. A proposer whose model can find
        it without its full logits (an EAGLE-3 head's draft vocabulary) overrides this;
        this is the reference it must equal."""
        return self.model.compute_logits(hidden)[:, : self.vocab_size].argmax(dim=-1)

    def _drop_stale_probs(self, batch: InputBatch) -> None:
        """Forget the q of requests the batch no longer holds (finished or preempted)."""
        for request_id in [r for r in self._draft_probs if r not in batch.row_of]:
            del self._draft_probs[request_id]

    # -- verifying ------------------------------------------------------------------------

    def prepare_verify(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        spec_token_ids: dict[str, list[int]],
    ) -> VerifyRows | None:
        """Pick the step's verify rows whose drafts were drawn from a ``q`` this proposer
        keeps (random requests, drafts a prefix of the last proposal) and copy their logits
        before the sampler edits them; None when there are none.

        ``logits`` are the step's sampling rows, ``states`` their requests (a request with
        ``d`` drafts has ``d + 1`` consecutive rows)."""
        if self.sampler is None or not self._draft_probs:
            return None
        index: list[int] = []
        draft_ids: list[int] = []
        is_bonus: list[bool] = []
        sources: list[tuple[torch.Tensor, int, int]] = []  # (flat q, its row, logits row)
        i = 0
        while i < len(states):
            state = states[i]
            drafts = spec_token_ids.get(state.request_id) or []
            entry = self._draft_probs.get(state.request_id)
            num_rows = 1 + len(drafts)
            if (
                drafts
                and entry is not None
                and entry.token_ids[: len(drafts)] == list(drafts)
                and state.sampling_params.temperature >= SAMPLING_EPS
            ):
                for m in range(num_rows):
                    if m < len(drafts):
                        sources.append((entry.flat, entry.base + m, len(index)))
                    index.append(i + m)
                    draft_ids.append(drafts[m] if m < len(drafts) else 0)
                    is_bonus.append(m == len(drafts))
            i += num_rows
        if not index:
            return None
        device = logits.device
        index_t = self._to_device(np.array(index, dtype=np.int64))
        draft_probs = torch.zeros(len(index), logits.shape[1], dtype=torch.float32, device=device)
        for flat in {id(f): f for f, _, _ in sources}.values():  # usually one step's tensor
            picked = [(row, at) for f, row, at in sources if f is flat]
            rows_t = self._to_device(np.array([row for row, _ in picked], dtype=np.int64))
            at_t = self._to_device(np.array([at for _, at in picked], dtype=np.int64))
            draft_probs.index_copy_(0, at_t, flat.index_select(0, rows_t))
        return VerifyRows(
            index=index_t,
            logits=logits.index_select(0, index_t).float(),
            draft_probs=draft_probs,
            draft_token_ids=self._to_device(np.array(draft_ids, dtype=np.int64)),
            is_bonus=self._to_device(np.array(is_bonus, dtype=bool)),
            states=[states[i] for i in index],
        )

    def verify(self, rows: VerifyRows, sampled_token_ids: torch.Tensor) -> torch.Tensor:
        """``sampled_token_ids`` (the sampler's ids for every row of the step) with the rows
        of ``rows`` replaced by rejection sampling's tokens, which the runner's exact-match
        rule (:func:`~chassis.core.speculative.accepted_tokens`) turns into the output. On
        the device, no host synchronization."""
        metadata = build_sampling_metadata(
            [s.sampling_row for s in rows.states], rows.logits.device, rows.logits.shape[1]
        )
        return sampled_token_ids.index_copy(0, rows.index, self._rejection_tokens(rows, metadata))

    def _rejection_tokens(self, rows: VerifyRows, metadata: SamplingMetadata) -> torch.Tensor:
        """``[rows]`` int64: rejection sampling's token of each verify row (the target's
        ``p`` from the sampler, against the drafts' ``q``)."""
        assert self.sampler is not None
        target_probs = self.sampler.probabilities(rows.logits, metadata)
        return rejection_sample(target_probs, rows.draft_probs, rows.draft_token_ids, rows.is_bonus)

    @torch.inference_mode()
    def profile_verify(self, logits: torch.Tensor) -> None:
        """The verify step's memory, for the start-up profile: call while the step's
        ``logits`` (``[rows, >= vocab]``, every sampling row the profile computes) are alive.
        With probabilistic drafts it holds the ``q`` of ``k`` drafts per request (kept from
        the proposal until verified) and runs the real verify path (:meth:`prepare_verify`'s
        copies and :meth:`_rejection_tokens`) on dummy values for up to
        ``max_num_seqs * (k + 1)`` rows, so the profile's peak holds every temporary of
        rejection sampling (the rows' logits and ``q``, ``p``, the masked ``q``, the
        residual, the noise and the race's quotients: 7 tensors of rows x vocab float32 at
        its peak) under a sampler with temperature only. Greedy drafts: nothing."""
        if self.sampler is None:
            return
        k = self.num_speculative_tokens
        vocab = self.vocab_size
        kept_q = torch.zeros(self.max_num_seqs * k, vocab, dtype=torch.float32, device=self.device)
        num_rows = min(logits.shape[0], self.max_num_seqs * (k + 1))
        index = torch.arange(num_rows, device=logits.device)
        rows = VerifyRows(
            index=index,
            logits=logits[:, :vocab].index_select(0, index).float(),
            draft_probs=torch.zeros(num_rows, vocab, dtype=torch.float32, device=logits.device),
            draft_token_ids=torch.zeros(num_rows, dtype=torch.int64, device=logits.device),
            is_bonus=index % (k + 1) == k,
            states=[],
        )
        metadata = build_sampling_metadata([_PROFILE_SAMPLING_ROW] * num_rows, logits.device, vocab)
        self._rejection_tokens(rows, metadata)
        del kept_q

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
        positions, token_rows, ctx = self._step_context(batch, rows, starts, query_lens)
        if input_ids is None:
            input_ids = batch.token_ids[token_rows, positions]
        return self.model(self._to_device(input_ids), self._to_device(positions), ctx)

    def _step_context(
        self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, ForwardContext]:
        """``(positions, batch row of each token, attention context)`` of a draft forward
        over ``query_lens[i]`` tokens of each of ``rows`` from position ``starts[i]``."""
        total = int(query_lens.sum())
        cu = np.cumsum(query_lens)
        query_start_loc = np.concatenate(([0], cu)).astype(np.int32)
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)
        positions = starts[req_of_token] + (np.arange(total) - query_start_loc[:-1][req_of_token])
        token_rows = rows[req_of_token]
        seq_lens = (starts + query_lens).astype(np.int32)
        slot_mappings, block_tables = group_slots_and_tables(
            batch, rows, token_rows, positions, int(seq_lens.max()), self.block_size
        )
        if self.layer_group is None:  # group 0's table (the only one, or a full group)
            slot_mappings, block_tables = slot_mappings[:1], block_tables[:1]
        ctx = packed_forward_context(
            query_start_loc,
            seq_lens,
            slot_mappings,
            block_tables,
            int(query_lens.max()),
            self._copy_metadata,
            self.kv_caches,
            self.layer_group,
            self.pin_memory,
        )
        return positions, token_rows, ctx

    def _copy_metadata(self, packed: torch.Tensor) -> torch.Tensor:
        return copy_packed(packed, self.device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device, self.pin_memory)


class _DraftChooser:
    """The drafts of one proposal, draft step by draft step: the argmax for greedy requests,
    a draw from ``q`` for random ones (when the proposer has a sampler), whose ``q`` rows it
    keeps in one ``[random requests * k, vocab]`` tensor."""

    def __init__(
        self, proposer: DraftModelProposer, states: list[RequestState], num_steps: int
    ) -> None:
        self.proposer = proposer
        self.states = states
        self.num_steps = num_steps
        self.slot = np.full(len(states), -1, dtype=np.int64)  # random requests' slots
        if proposer.sampler is not None:
            # Seeded requests keep one-hot drafts: exact-match verification keeps their
            # stream at one draw per output token (core/seeded_drafts.py).
            random = [
                s.sampling_params.temperature >= SAMPLING_EPS and s.sampling_params.seed is None
                for s in states
            ]
            self.slot[np.array(random, dtype=bool)] = np.arange(sum(random))
        num_random = int((self.slot >= 0).sum())
        self.flat: torch.Tensor | None = None
        if num_random:
            self.flat = torch.zeros(
                num_random * num_steps,
                proposer.vocab_size,
                dtype=torch.float32,
                device=proposer.device,
            )
        self._metadata_key: tuple[int, ...] = ()
        self._metadata = None

    def __call__(self, hidden: torch.Tensor, alive: np.ndarray, step: int) -> list[int]:
        """The draft tokens at draft step ``step`` of the requests ``alive`` (by position in
        ``states``), whose draft hidden states are ``hidden``; one host read."""
        proposer = self.proposer
        tokens = proposer.greedy_drafts(hidden)
        random = np.nonzero(self.slot[alive] >= 0)[0]  # by position in alive
        if len(random):
            assert proposer.sampler is not None and self.flat is not None
            picked = proposer._to_device(random)
            # Only the random requests' rows need logits over the whole vocabulary (q).
            logits = proposer.model.compute_logits(hidden.index_select(0, picked))
            q = proposer.sampler.probabilities(
                logits[:, : proposer.vocab_size].float(), self._metadata_for(alive[random])
            )
            tokens = tokens.index_copy(0, picked, exponential_race(q))
            slots = self.slot[alive[random]] * self.num_steps + step
            self.flat.index_copy_(0, proposer._to_device(slots), q)
        return tokens.tolist()

    def _metadata_for(self, requests: np.ndarray):
        key = tuple(requests.tolist())
        if key != self._metadata_key:  # the same requests draft every step, mostly
            self._metadata_key = key
            self._metadata = build_sampling_metadata(
                [self.states[a].sampling_row for a in key],
                self.proposer.device,
                self.proposer.vocab_size,
            )
        return self._metadata

    def probs_of(self, a: int, token_ids: list[int]) -> _DraftProbs | None:
        """What verifying request ``a``'s drafts ``token_ids`` needs; None for a greedy
        draft (one-hot, verified by exact match)."""
        slot = int(self.slot[a])
        if slot < 0 or self.flat is None:
            return None
        base = slot * self.num_steps
        return _DraftProbs(token_ids=token_ids, flat=self.flat, base=base)
