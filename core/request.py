"""The engine core's view of one request, and the messages that cross the process boundary."""

from __future__ import annotations

import enum
import time

import msgspec

from chassis.core.lora.request import LoRARequest
from chassis.core.multimodal import MultiModalFeature, MultiModalTensor
from chassis.core.pooling_params import PoolingParams
from chassis.core.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


# ---------------------------------------------------------------------------------------------
# Messages (msgspec Structs, msgpack on the wire; never pickle)
# ---------------------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tokenized request sent from the front-end to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    #: Token ids that end generation unless ``ignore_eos`` (the model's EOS ids).
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0
    #: the LoRA adapter the request runs with (None: the base model)
    lora_request: LoRARequest | None = None
    #: vLLM's ``cache_salt``: the request's prefix-cache entries are shared only with
    #: requests of the same salt (None: with every request without one)
    cache_salt: str | None = None
    #: set for a pooling request (an engine with ``runner="pooling"``): it finishes when its
    #: prompt is computed and returns a vector (``EngineCoreOutput.pooled``); its
    #: ``sampling_params`` are then unused
    pooling_params: PoolingParams | None = None
    #: the request's images, processed, in prompt order (their placeholder tokens are in
    #: ``prompt_token_ids``): :mod:`chassis.core.multimodal`; empty for text
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)
    #: the prompt given as input embeddings ``[len(prompt_token_ids), hidden_size]`` (then
    #: every prompt token id is a placeholder): :mod:`chassis.core.prompt_embeds`
    prompt_embeds: MultiModalTensor | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    #: 1-based rank of the chosen token in the full distribution.
    rank: int


class RequestError(msgspec.Struct, kw_only=True, frozen=True):
    """Why the engine core ended one request early because of a fault in it (the other
    requests go on). Sent with its last output, whose finish reason is ``abort``."""

    message: str
    #: whether the request itself is at fault (its structured-output constraint needs more
    #: work than the budget allows, or does not compile; its LoRA adapter id belongs to
    #: another folder: HTTP 400), rather than the engine failing to serve it (a matcher
    #: raising an unexpected error; an adapter folder the front-end checked that can no
    #: longer be loaded: HTTP 500)
    client_error: bool = False
    #: the engine was asleep (sleep mode) when the request arrived, so nothing ran; the
    #: front-ends raise :class:`~chassis.core.errors.EngineSleepingError` (HTTP 503)
    engine_sleeping: bool = False


def engine_fault(what: str, exc: BaseException) -> RequestError:
    """The :class:`RequestError` of a request the engine failed to serve (HTTP 500) because
    ``exc`` was raised while ``what`` (e.g. ``"structured output: computing the mask
    failed"``): ``what`` and the exception's type only. The message of an exception the
    engine did not write for clients may carry internals (paths, a backend's or a worker's
    traceback text), so, as for an engine-core crash
    (``chassis.core.engine_core_proc.crash_message_for_clients``), clients get a pointer to
    the server log, where the caller logs ``exc`` whole with its traceback. The request's own
    faults (``client_error``) keep their messages, which are written for clients."""
    return RequestError(
        message=f"{what}: {type(exc).__name__} in the engine core; its message and "
        "traceback are in the server log"
    )


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    #: For the first output of a request with ``prompt_logprobs``: one entry per prompt
    #: token (the first is ``None``: nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    #: The stop token id that ended the request, if any.
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    #: Wall-clock time (``time.time()``) the request was first scheduled; sent once, with the
    #: request's first output.
    first_scheduled_time: float | None = None
    #: A pooling request's vector (little-endian float32 bytes), with its only output.
    pooled: bytes | None = None
    #: set (with ``finish_reason`` ``abort``) when the engine failed this request alone
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True):
    """A snapshot of the scheduler, sent with outputs for metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    #: speculative decoding, since start: draft tokens verified, and those accepted
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    #: speculative decoding, since start: drafts verified (one per request and step that
    #: verified at least one draft token), and per draft position (0 first) the drafts
    #: whose token there was accepted
    spec_num_drafts: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    #: with --enable-lora (``max_loras`` > 0): the adapters (names) of the running and the
    #: waiting requests, sorted
    max_loras: int = 0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message from the engine core to the front-end."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    timestamp: float = 0.0
    stats: SchedulerStats | None = None
    #: Set when the engine core hit a fatal error; the front-end fails every request.
    engine_error: str | None = None
    #: which engine core sent it (data parallelism: its index, set by the front-end's
    #: ``DataParallelClient``; 0 with one engine)
    engine_index: int = 0


# ---------------------------------------------------------------------------------------------
# Engine-core-side state
# ---------------------------------------------------------------------------------------------


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Mutable state of one request inside the engine core (owned by the scheduler)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
        mm_features: list[MultiModalFeature] | tuple[MultiModalFeature, ...] = (),
        prompt_embeds: MultiModalTensor | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        #: set for a pooling request: prefill only, finished by its pooled vector
        self.pooling_params = pooling_params
        #: the prompt's multimodal items in prompt order (:mod:`chassis.core.multimodal`)
        self.mm_features = list(mm_features)
        #: the prompt's input embeddings when it was given as such (its token ids are then
        #: placeholders: :mod:`chassis.core.prompt_embeds`); None otherwise
        self.prompt_embeds = prompt_embeds
        #: ``(start, end)`` prompt ranges whose tokens attend to one another both ways (the
        #: image placeholders of a model with ``bidirectional_image_blocks``, set by the
        #: engine core): a scheduler never ends a prefill chunk strictly inside one
        #: (:func:`chassis.core.bidirectional_blocks.chunk_outside_blocks`); empty otherwise
        self.bidirectional_blocks: list[tuple[int, int]] = []
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        #: Tokens whose K/V are in the cache (prefix hits included).
        self.num_computed_tokens = 0
        #: Tokens a step already sent to the runner will sample, not known yet (async
        #: scheduling plans the next step before they are): counted as tokens when planning.
        self.num_output_placeholders = 0
        #: Tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        #: wall-clock time of the first scheduling (None while waiting for it)
        self.first_scheduled_time: float | None = None
        #: whether an output has carried first_scheduled_time to the front-end yet
        self.first_scheduled_time_sent = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        #: draft tokens the plan in flight verifies (speculative decoding), else empty
        self.spec_token_ids: list[int] = []

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            req.arrival_time or None,
            req.priority,
            req.lora_request,
            req.pooling_params,
            req.cache_salt,
            req.mm_features,
            req.prompt_embeds,
        )

    @property
    def lora_int_id(self) -> int:
        """The id of the request's LoRA adapter; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )
