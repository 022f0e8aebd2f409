"""The scheduler interface and the messages between scheduler and model runner.

Each engine step: ``schedule()`` decides which requests run and how many tokens each gets,
the model runner executes that :class:`SchedulerOutput` and returns a
:class:`ModelRunnerOutput`, and ``update_from_output`` appends sampled tokens, applies stop
conditions and returns what each request produced.

:class:`SchedulerOutput` is a *diff* against the runner's persistent batch: requests appear in
``new_requests`` once (again after a preemption), then only as ``cached_requests``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

# At run time, not only for type checking: the tensor-parallel executor decodes
# SchedulerOutput with msgspec, which resolves the field types.
from chassis.core.lora.request import LoRARequest
from chassis.core.multimodal import MultiModalFeature, MultiModalTensor
from chassis.core.pooling_params import PoolingParams
from chassis.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.kv_cache_manager import KVCacheManager
    from chassis.core.request import (
        EngineCoreOutput,
        Request,
        SchedulerStats,
        TokenLogprobs,
    )


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    #: tokens generated before a preemption; the runner recomputes their K/V
    output_token_ids: list[int]
    sampling_params: SamplingParams
    #: its block table, one list per KV cache group (``KVCacheManager.num_groups``: one
    #: unless the model mixes sliding-window and full-attention layers: ModelRunner.kv_groups)
    block_ids: list[list[int]]
    #: tokens whose K/V are already cached (prefix-cache hits)
    num_computed_tokens: int
    #: the request's EOS ids (the sampler blocks them until ``min_tokens``)
    eos_token_ids: frozenset[int] = frozenset()
    #: the LoRA adapter the request runs with (None: the base model)
    lora_request: LoRARequest | None = None
    #: set for a pooling request (``runner="pooling"``): prefill only, pooled, not sampled
    pooling_params: PoolingParams | None = None
    #: per KV cache group, how many leading entries of ``block_ids`` are the null block (a
    #: sliding-window prefix-cache hit needs only the window's blocks); empty when none
    num_null_blocks: list[int] = field(default_factory=list)
    #: the prompt's multimodal items (:mod:`chassis.core.multimodal`); empty for text
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    #: the prompt's input embeddings when it was given as such
    #: (:mod:`chassis.core.prompt_embeds`); None otherwise
    prompt_embeds: MultiModalTensor | None = None


@dataclass
class CachedRequestData:
    """A request already in the runner's batch."""

    request_id: str
    #: blocks to append to its block table, one list per KV cache group
    new_block_ids: list[list[int]]
    #: tokens whose K/V are cached *before* this step (this step computes the next ones)
    num_computed_tokens: int
    #: per KV cache group, how many leading entries of its block table are now the null
    #: block (``chassis.core.block_pool.NULL_BLOCK_ID``): blocks released because no layer
    #: of the group's window reads them any more (``KVCacheManager``); empty when none. A
    #: count, not a list of entries: one int per group whatever the request's length, and
    #: the runner nulls only the entries past the count it already applied
    num_null_blocks: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """The plan for one step."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    #: request id -> tokens to compute this step (prefill chunk length, or 1 for a decode)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    #: finished, aborted or preempted since the last step: the runner drops them
    finished_request_ids: set[str] = field(default_factory=set)
    #: request id -> the tokens it may sample this step, a ``bool [vocab_size]`` mask packed
    #: with ``np.packbits`` (structured outputs; set by the engine core after ``schedule()``,
    #: not by schedulers); the runner masks the other tokens' logits of a row that samples
    allowed_token_masks: dict[str, bytes] = field(default_factory=dict)
    #: request id -> draft tokens to verify this step (speculative decoding): the request's
    #: ``num_scheduled_tokens`` are its last token plus these; the runner returns the drafts
    #: the model agreed with plus one token of its own (``core/speculative.py``)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """What the runner computed for a :class:`SchedulerOutput`."""

    #: request ids in the order of the other lists
    request_ids: list[str] = field(default_factory=list)
    #: sampled tokens per request; empty for a prefill chunk that does not end the prompt
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    #: per request, the logprobs of its sampled token (None where not requested or no sample)
    logprobs: list[TokenLogprobs | None] | None = None
    #: request id -> prompt logprobs, present once, when the request's prefill completes
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    #: pooling requests whose prompt this step completed: request id -> the pooled vector
    #: (little-endian float32 bytes, ``chassis.core.pooling_outputs.POOLED_DTYPE``)
    pooled: dict[str, bytes] = field(default_factory=dict)
    #: request id -> the drafts a draft model proposes for its next step (speculative
    #: decoding with ``method: "draft_model"``; ``core/draft_model.py``); the scheduler may
    #: plan them as that step's ``SchedulerOutput.spec_token_ids``
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


class Scheduler(ABC):
    """Decides, step by step, which requests run. Register with ``chassis_register_schedulers``.

    The engine core is the only caller; no method is called concurrently.

    **Async scheduling** (``--async-scheduling``, only with schedulers whose
    :attr:`supports_async_scheduling` is ``True``): the engine core calls ``schedule()`` for
    step N+1 *before* ``update_from_output`` of step N, so a request that samples in step N
    may be planned again while that token is unknown. Such a scheduler counts the tokens its
    sent plans will sample (``Request.num_output_placeholders`` in the built-in one), plans the
    decode of an unknown token like any other (the runner takes its id from the device), must
    not plan a request that is bound to stop by length once those tokens arrive, and must
    accept results for requests that were preempted, aborted or finished meanwhile (they are
    dropped; a preempted request resamples the token), including an aborted request whose id
    was given to a new request before the results came in (they belong to the old one).
    ``update_from_output`` is still called once per plan, in plan order, with the plan object
    ``schedule()`` returned.
    """

    #: whether this scheduler honours the async-scheduling contract above
    supports_async_scheduling: ClassVar[bool] = False
    #: whether this scheduler orders requests by ``Request.priority``; a request with a
    #: non-zero priority is refused (``ValueError``, as vLLM) by a scheduler that would ignore it
    uses_priority: ClassVar[bool] = False
    #: whether this scheduler finishes pooling requests (``runner="pooling"``): in
    #: ``update_from_output``, each request in ``ModelRunnerOutput.pooled`` finishes (reason
    #: ``stop``) with that vector as ``EngineCoreOutput.pooled``; a pooling engine refuses a
    #: scheduler without it (its requests would never finish)
    supports_pooling: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status ``WAITING``)."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish these requests with reason ``abort`` and free their blocks.

        Unknown or already-finished ids are ignored. Aborted ids are reported to the runner in
        the next ``SchedulerOutput.finished_request_ids``.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step within ``max_num_batched_tokens`` and ``max_num_seqs``."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance request states with the step's results.

        Appends sampled tokens, applies stop conditions (EOS unless ``ignore_eos``,
        ``stop_token_ids``, ``max_tokens``, ``min_tokens``, ``max_model_len``), frees the
        blocks of finished requests, and returns one output per request that produced
        tokens or finished.
        """

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """A snapshot for metrics."""
