"""``AsyncLLM``: the asyncio client of an engine-core child process (used by the server), or
of several with ``data_parallel_size`` above 1 (:mod:`chassis.core.dp_client`).

Tokenization happens in the caller's event loop (off-loaded to a thread for long prompts);
decoding of engine messages and detokenization happen on the client's output thread, which
hands finished ``RequestOutput``s to per-request asyncio queues. The event loop never blocks
on engine I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from chassis.core.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    check_prompt_fits,
    engine_step,
    run_beam_search_async,
    sequence_text,
    step_sampling_params,
)
from chassis.core.config import EngineConfig
from chassis.core.data_parallel import check_data_parallel
from chassis.core.dp_client import DataParallelClient
from chassis.core.engine_client import EngineCoreClient
from chassis.core.engine_setup import finalize_config
from chassis.core.errors import (
    EngineDeadError,
    EngineSleepingError,
    RequestFailedError,
    request_failure,
)
from chassis.core.input_processor import InputProcessor
from chassis.core.lora.request import LoRARequest
from chassis.core.output_processor import OutputProcessor
from chassis.core.outputs import RequestOutput, merge_delta_outputs
from chassis.core.pause_state import check_pause_mode
from chassis.core.pooling_config import apply_pooling_defaults
from chassis.core.pooling_input import EmbeddingModelInfo, process_pooling
from chassis.core.pooling_outputs import EmbeddingRequestOutput
from chassis.core.pooling_params import PoolingParams
from chassis.core.prompt_embeds import EmbedsPrompt
from chassis.core.request import EngineCoreOutputs, SchedulerStats
from chassis.core.sampling_params import SamplingParams
from chassis.core.sleep_mode import (
    check_sleep_level,
    check_sleep_mode_enabled,
    check_wake_tags,
    sleeping_message,
)
from chassis.core.stat_logger import IterationStats, StatLoggerBase, StatLoggerInfo
from chassis.core.stat_logger_manager import (
    StatLoggerFactory,
    StatLoggerManager,
    default_stat_loggers,
    resolve_stat_loggers,
)
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: how often a caller waiting for the engine core to drain its requests asks again
_POLL_SECONDS = 0.02

#: prompts longer than this (characters) are tokenized in a worker thread
_THREAD_TOKENIZE_CHARS = 4096

T = TypeVar("T")


class AsyncLLM:
    """Submit prompts, stream ``RequestOutput``s; the engine core runs in a child process."""

    def __init__(
        self, config: EngineConfig, *, stat_loggers: Sequence[StatLoggerFactory] = ()
    ) -> None:
        """Start the engine core for ``config`` (blocking until it is ready); with
        ``config.data_parallel_size`` N above 1, N engine cores (all ready), between which
        requests are balanced (``ValueError`` when the host lacks devices for them).

        Stat loggers: those ``config.stat_loggers`` names (unset: ``["logging"]``), then
        ``stat_loggers`` (classes, or callables taking a
        :class:`~chassis.core.stat_logger.StatLoggerInfo`). An unknown name raises
        ``ValueError`` before the engine core starts.
        """
        hf_config = finalize_config(config)
        check_data_parallel(config)  # enough devices for every engine, before any starts
        self.config = config
        assert config.tokenizer is not None and config.served_model_name is not None
        self.model_name: str = config.served_model_name
        #: a pooling engine's pooling (None when it generates), and what encode() checks
        self.pooler_config = apply_pooling_defaults(config)
        self.embedding_info = (
            EmbeddingModelInfo.from_hf_config(hf_config, self.model_name, self.pooler_config)
            if self.pooler_config is not None
            else None
        )
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_callbacks: list[Callable[[], None]] = []
        self.dead_error: EngineDeadError | None = None
        #: the parts of the engine asleep (sleep mode), as the last sleep / wake_up left them
        self._sleeping_tags: list[str] = []
        self._stats = SchedulerStats()
        names = default_stat_loggers() if config.stat_loggers is None else config.stat_loggers
        factories = resolve_stat_loggers(names)
        factories += [(getattr(f, "__qualname__", repr(f)), f) for f in stat_loggers]
        self._stat_loggers: StatLoggerManager | None = None
        # The tokenizer loads while the engine core child starts (imports, model load).
        # With --data-parallel-size N, N engine cores start and requests are balanced
        # between them (core/dp_client.py); the rest of this class sees one engine.
        client_cls = EngineCoreClient if config.data_parallel_size == 1 else DataParallelClient
        self.client: EngineCoreClient | DataParallelClient = client_cls(
            config,
            self._on_outputs,
            self._on_dead,
            while_starting=lambda: self._load_tokenizer(hf_config),
        )
        #: the engine core's start-up report (engine 0's with data parallelism)
        self.engine_info = self.client.info
        #: every engine core's report, in engine order (one without data parallelism)
        self.engine_infos = self.client.infos
        try:
            self._stat_loggers = StatLoggerManager(
                factories,
                StatLoggerInfo(self.model_name, config, self.engine_info),
                config.stat_log_interval,
            )
        except BaseException:
            self.client.shutdown()
            raise
        self.input_processor.lora_target_shapes = self.engine_info.lora_target_shapes

    def _load_tokenizer(self, hf_config: Any) -> None:
        """The tokenizer and the input and output processors that use it."""
        config = self.config
        # None with skip_tokenizer_init: token-id prompts only, outputs with empty text.
        self.tokenizer = None if config.skip_tokenizer_init else engine_tokenizer(config)
        if self.tokenizer is None:
            self.input_processor = InputProcessor(
                None,
                config,
                eos_token_ids(None, config.model, hf_config=hf_config),
                vocab_size=int(hf_config.vocab_size),
            )
        else:
            self.input_processor = InputProcessor(
                self.tokenizer, config, eos_token_ids(self.tokenizer, config.model)
            )
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> AsyncLLM:
        """Resolve the model, load the tokenizer and start the engine core (blocking)."""
        return cls(config)

    # -- state ----------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def stats(self) -> SchedulerStats:
        """The latest scheduler snapshot the engine core sent (data parallelism: the sum
        over the engines' latest ones)."""
        return self._stats

    def engine_stats(self) -> list[SchedulerStats]:
        """Each engine core's latest scheduler snapshot, in engine order (``/metrics``'
        ``engine`` label); ``[stats()]`` with one engine."""
        client = self.client
        if isinstance(client, DataParallelClient):
            return client.engine_stats
        return [self._stats]

    @property
    def stat_loggers(self) -> list[StatLoggerBase]:
        """The running stat loggers (those not disabled), in the order they were named."""
        return [] if self._stat_loggers is None else self._stat_loggers.loggers

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine core is not running."""
        if self.dead_error is not None:
            raise self.dead_error
        if not self.client.is_alive:
            raise EngineDeadError("the engine core is not running")

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) once, when the engine core dies."""
        # Outside a running loop the callback runs on the client's monitor thread.
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        self._dead_callbacks.append(callback)

    # -- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        delta: bool = True,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (``n`` completions as ``outputs[i].index``),
        with the LoRA adapter ``lora_request`` (``None``: the base model); ``cache_salt``
        shares its prefix-cache entries only with requests of the same salt;
        ``multi_modal_data`` and ``mm_processor_kwargs`` (vLLM's) are the prompt's images
        (:meth:`InputProcessor.process`), processed off the event loop.

        Bad input raises ``ValueError`` before anything is yielded; a dead engine raises
        :class:`EngineDeadError`, a sleeping one (sleep mode) :class:`EngineSleepingError`;
        a request the engine core failed alone (its
        structured-output constraint over its work budget, its matcher raising, its LoRA
        adapter refused: reused id, or a folder that cannot be loaded any more) raises
        :class:`RequestFailedError` with the engine's message, instead of that output (its
        other completions are aborted). Closing the iterator early aborts the request.
        """
        self._refuse_generation()
        self._loop = asyncio.get_running_loop()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        process = functools.partial(
            self.input_processor.process,
            prompt,
            sampling_params,
            request_id,
            priority,
            arrival,
            lora_request=lora_request,
            cache_salt=cache_salt,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
        )
        requests = await self._off_loop_when_slow(
            process, prompt, sampling_params, lora_request, multi_modal_data
        )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self.output_processor.add_request(
                request_id,
                prompt if isinstance(prompt, str) else None,
                requests[0].prompt_token_ids,
                sampling_params,
                [r.request_id for r in requests],
                arrival,
                delta,
            )
        finished = False
        try:
            self.client.add_requests(requests)  # all to one engine
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                _raise_if_failed(item)
                # A consumer that fell behind gets what has queued up as one output: fewer,
                # larger stream events instead of a backlog of one-token ones. An abort,
                # engine death or failure of this request queued behind them is raised after
                # they are yielded.
                error: BaseException | None = None
                while not item.finished and not queue.empty():
                    following = queue.get_nowait()
                    if isinstance(following, BaseException):
                        error = following
                        break
                    error = _failure(following)
                    if error is not None:
                        break
                    item = merge_delta_outputs(item, following) if delta else following
                finished = item.finished
                yield item
                if finished:
                    return
                if error is not None:
                    raise error
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def check_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Every refusal :meth:`generate` would make for this request before anything is
        yielded (the same ``ValueError``; :class:`EngineDeadError` for a dead engine),
        without submitting it: the input processor's own checks
        (:meth:`InputProcessor.check`). For a caller that answers before it starts the
        request (the server's background responses). What only the engine core finds out
        (a constraint over its work budget, an adapter folder deleted since) still fails
        the request later."""
        self._refuse_generation()
        check = functools.partial(
            self.input_processor.check,
            prompt,
            sampling_params,
            priority,
            lora_request=lora_request,
            cache_salt=cache_salt,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
        )
        await self._off_loop_when_slow(
            check, prompt, sampling_params, lora_request, multi_modal_data
        )

    def _refuse_if_asleep(self) -> None:
        """:class:`EngineSleepingError` while any part of the engine sleeps (as the last
        sleep / wake_up left it)."""
        if self._sleeping_tags:
            raise EngineSleepingError(sleeping_message(self._sleeping_tags))

    def _refuse_generation(self) -> None:
        """The engine-wide refusals of a generation request: a dead engine, a sleeping one
        (:class:`EngineSleepingError`), a pooling one."""
        if self.dead_error is not None:
            raise self.dead_error
        self._refuse_if_asleep()
        if self.pooler_config is not None:
            raise ValueError(
                "this server runs a pooling model (--runner pooling): it serves /v1/embeddings, "
                "/pooling, /classify, /score and /rerank, not text generation (completions, "
                "chat or responses)"
            )

    @staticmethod
    async def _off_loop_when_slow(
        call: Callable[[], T],
        prompt: str | list[int] | EmbedsPrompt,
        sampling_params: SamplingParams,
        lora_request: LoRARequest | None,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> T:
        """``call()`` (the input processor on one request), in a worker thread when it may
        be slow: a long text prompt to tokenize, a new structured-output constraint to
        compile (up to ~0.1 s for a large schema), a LoRA adapter whose first check reads its
        files, images to process, a prompt given as embeddings (every value checked, the
        rows copied to bytes); on the event loop otherwise."""
        long_prompt = isinstance(prompt, str) and len(prompt) > _THREAD_TOKENIZE_CHARS
        if (
            long_prompt
            or isinstance(prompt, EmbedsPrompt)
            or sampling_params.structured_outputs is not None
            or lora_request is not None
            or multi_modal_data is not None
        ):
            return await asyncio.to_thread(call)
        return call()

    async def beam_search(
        self,
        prompt: str | list[int],
        params: BeamSearchParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> BeamSearchOutput:
        """vLLM's beam search for one prompt (:mod:`chassis.core.beam_search`): each step's
        beams are requests ``{request_id}-{step}-{beam}``, awaited concurrently. Sequences
        and their text as :meth:`LLM.beam_search <chassis.core.llm.LLM.beam_search>` returns
        them. Bad input raises ``ValueError`` before the first step; cancelling the call
        aborts the step in flight."""
        token_ids = (
            self.input_processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        )
        check_prompt_fits(len(token_ids), params.max_tokens, self.input_processor.max_model_len)
        step_params = step_sampling_params(
            params, self.input_processor.vocab_size, self.config.max_logprobs
        )
        step = engine_step(self.generate, step_params, request_id, lora_request=lora_request)
        search = BeamSearch([token_ids], params, self.input_processor.eos_token_ids)
        [output] = await run_beam_search_async(search, step)
        for sequence in output.sequences:
            sequence.text = sequence_text(
                self.tokenizer, sequence, params.include_stop_str_in_output
            )
        return output

    async def encode(
        self,
        prompt: str | list[int],
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """Pool one prompt (vLLM's ``AsyncLLM.encode``): yields one finished
        :class:`EmbeddingRequestOutput`. Needs an engine with ``runner="pooling"``.
        ``lora_request``: the LoRA adapter to pool with (``None``: the base model).

        Bad input (or a generating engine) raises ``ValueError`` before anything is sent to
        the engine; a dead engine raises :class:`EngineDeadError`; a request the engine core
        refused (its LoRA adapter cannot be loaded any more, say) raises
        :class:`RequestFailedError` with the engine's message. Closing the iterator before
        the output arrives aborts the request.
        """
        if self.dead_error is not None:
            raise self.dead_error
        self._refuse_if_asleep()
        if self.pooler_config is None:
            raise ValueError(
                "this engine generates: embeddings need a pooling model, served with "
                "--runner pooling (runner='pooling')"
            )
        assert self.embedding_info is not None  # set for every pooling engine
        self._loop = asyncio.get_running_loop()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        process = functools.partial(
            process_pooling,
            self.input_processor,
            self.embedding_info,
            prompt,
            pooling_params,
            request_id,
            priority,
            add_special_tokens=add_special_tokens,
            lora_request=lora_request,
        )
        long_prompt = isinstance(prompt, str) and len(prompt) > _THREAD_TOKENIZE_CHARS
        # (an adapter's first check reads its files: off the event loop, as in generate)
        if long_prompt or lora_request is not None:
            request = await asyncio.to_thread(process)
        else:
            request = process()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self.output_processor.add_pooling_request(
                request_id,
                prompt if isinstance(prompt, str) else None,
                request.prompt_token_ids,
                request.arrival_time,
            )
        finished = False
        try:
            self.client.add_request(request)
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = True
            if isinstance(item, EmbeddingRequestOutput) and item.error is not None:
                raise request_failure(item.error)
            if not isinstance(item, EmbeddingRequestOutput) or not item.outputs.embedding:
                raise RuntimeError(f"the engine refused pooling request {request_id!r}")
            yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are freed. Unknown ids are ignored."""
        self._abort(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix in the engine core (between two of its steps): later
        requests compute their prompts from scratch until their blocks are cached again;
        running requests are not disturbed. ``True`` once done (see
        :meth:`~chassis.core.engine_core.EngineCore.reset_prefix_cache`). Raises
        :class:`EngineDeadError` when the engine core is not running."""
        await self.check_health()
        return bool(await asyncio.wrap_future(self.client.call_utility("reset_prefix_cache")))

    # -- sleep mode (docs/serving.md, "Sleep mode") -----------------------------------------

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the engine's memory (vLLM's ``AsyncLLM.sleep``; needs
        ``--enable-sleep-mode``): level 1 moves the weights to host memory (on the CPU they
        stay) and frees the KV cache, forgetting the prefix cache; level 2 frees the weights
        too. Unfinished requests are first aborted (``mode="abort"``, vLLM's default: their
        streams end with finish reason ``abort``), or waited for while new ones are held
        (``"wait"``: returns once they finished and the engine sleeps), or the sleep is
        refused with :class:`~chassis.core.errors.EngineBusyError` when there are any
        (``"keep"``). Until :meth:`wake_up` brought everything back, requests are refused
        with :class:`EngineSleepingError`. ``ValueError`` without sleep mode or for another
        level or mode; :class:`EngineDeadError` when the engine core is not running."""
        check_sleep_mode_enabled(self.config)
        check_sleep_level(level)
        check_pause_mode(mode)
        await self.check_health()
        tags = await self._utility("sleep", level, mode)
        while not tags:  # mode "wait": the engine core sleeps once its requests finished
            await asyncio.sleep(_POLL_SECONDS)
            waiting, tags, error = await self._utility("sleep_progress")
            if error is not None and not waiting and not tags:
                raise RuntimeError(f"sleep failed once the requests finished: {error}")
            if not waiting and not tags:  # woken up meanwhile by another caller
                break
        self._sleeping_tags = list(tags)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed: ``tags`` names the parts, ``"weights"`` and
        ``"kv_cache"`` (``None``: both), in any order over several calls. Weights freed at
        level 2 are loaded from the checkpoint again. ``ValueError`` for another tag or
        without sleep mode; :class:`EngineDeadError` when the engine core is not running."""
        check_sleep_mode_enabled(self.config)
        check_wake_tags(tags)
        await self.check_health()
        wake_tags = None if tags is None else list(tags)
        asleep = await asyncio.wrap_future(self.client.call_utility("wake_up", wake_tags))
        self._sleeping_tags = list(asleep)

    async def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps (asked of the engine core)."""
        if not self.config.enable_sleep_mode:
            return False
        await self.check_health()
        return bool(await asyncio.wrap_future(self.client.call_utility("is_sleeping")))

    # -- pausing generation (docs/serving.md, "Pausing generation") ---------------------------

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop starting requests until :meth:`resume_generation` (vLLM's; e.g. while a
        trainer updates the weights): requests made meanwhile wait in the engine core.
        ``mode`` says what happens to the unfinished ones: ``"abort"`` (default) ends them
        now with finish reason ``abort``, ``"wait"`` returns once they have finished,
        ``"keep"`` freezes them (their KV cache kept) until resumed. ``clear_cache`` forgets
        the prefix cache once they are done (not with ``"keep"``). ``ValueError`` for
        another mode; :class:`EngineDeadError` when the engine core is not running."""
        check_pause_mode(mode)
        await self.check_health()
        drained = await self._utility("pause", mode, bool(clear_cache))
        while not drained:
            await asyncio.sleep(_POLL_SECONDS)
            drained = await self._utility("pause_drained")

    async def resume_generation(self) -> None:
        """Lift :meth:`pause_generation`: frozen requests go on and the requests made
        meanwhile start, in their order. Not paused: nothing to do."""
        await self.check_health()
        await self._utility("resume")

    async def is_paused(self) -> bool:
        """Whether generation is paused (asked of the engine core)."""
        await self.check_health()
        return bool(await self._utility("is_paused"))

    async def _utility(self, method: str, *args: Any) -> Any:
        """Run engine-core method ``method`` between two of its steps; its result."""
        return await asyncio.wrap_future(self.client.call_utility(method, *args))

    def _abort(self, request_id: str) -> None:
        with self._lock:
            child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                self.client.abort(child_ids)

    # -- output thread --------------------------------------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self._stats = outputs.stats
        loggers = self._stat_loggers
        if not outputs.outputs:
            if loggers is not None:
                step = IterationStats(timestamp=time.time(), engine_index=outputs.engine_index)
                loggers.record(self._stats, step)
            return
        with self._lock:
            processed = self.output_processor.process_outputs(outputs)
        if loggers is not None:  # before delivery: a caller sees its output after the count
            loggers.record(self._stats, processed.iteration_stats)
        if processed.request_ids_to_abort:
            self.client.abort(processed.request_ids_to_abort)
        loop = self._loop
        if loop is None or loop.is_closed() or not processed.request_outputs:
            return
        # One wake-up of the event loop per engine step, not one per request.
        loop.call_soon_threadsafe(self._deliver, processed.request_outputs)

    def _deliver(self, request_outputs: list[RequestOutput]) -> None:
        """On the event loop: hand each output to its request's queue (if still open)."""
        for request_output in request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)

    def _on_dead(self, reason: str) -> None:
        self.dead_error = EngineDeadError(reason)
        loop = self._loop
        if loop is None or loop.is_closed():
            for cb in self._dead_callbacks:
                cb()
            return

        def fail_everything() -> None:
            for queue in list(self._queues.values()):
                queue.put_nowait(self.dead_error or EngineDeadError(reason))
            for cb in self._dead_callbacks:
                try:
                    cb()
                except Exception:
                    logger.exception("dead-engine callback failed")

        loop.call_soon_threadsafe(fail_everything)

    # -- shutdown -------------------------------------------------------------------------

    def shutdown_sync(self) -> None:
        self.client.shutdown()
        if self._stat_loggers is not None:
            self._stat_loggers.shutdown()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.shutdown_sync)


def _failure(output: RequestOutput) -> RequestFailedError | EngineSleepingError | None:
    """The :class:`RequestFailedError` of ``output`` if the engine core failed a completion
    of it (:class:`EngineSleepingError` if it refused it while asleep), else ``None``."""
    for completion in output.outputs:
        if completion.error is not None:
            return request_failure(completion.error)
    return None


def _raise_if_failed(output: RequestOutput) -> None:
    """Raise :func:`_failure` of ``output``, if any."""
    failure = _failure(output)
    if failure is not None:
        raise failure
