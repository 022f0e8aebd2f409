"""The engine core: the only owner of scheduler and KV state; one ``step()`` per iteration."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec

from chassis.core.async_scheduling_default import resolve_async_scheduling
from chassis.core.config import EngineConfig
from chassis.core.errors import EngineBusyError
from chassis.core.executor import make_executor
from chassis.core.in_flight import PendingRunnerOutput
from chassis.core.kv_cache_manager import KVCacheManager
from chassis.core.lora.request import LoRARequest
from chassis.core.multimodal_admission import multimodal_refusal
from chassis.core.pause_state import PauseState, check_pause_mode
from chassis.core.pooling_config import apply_pooling_defaults
from chassis.core.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Request,
    RequestError,
    engine_fault,
)
from chassis.core.scheduler_interface import SchedulerOutput
from chassis.core.sleep_mode import (
    SleepState,
    check_sleep_level,
    check_sleep_mode_enabled,
    check_wake_tags,
    sleeping_message,
)
from chassis.core.structured_output_manager import (
    StructuredOutputManager,
    StructuredOutputsUnavailable,
)

logger = logging.getLogger(__name__)


class EngineInfo(msgspec.Struct, kw_only=True):
    """What the engine core reports once it is ready (sent to the front-end)."""

    platform: str
    attention_backend: str
    scheduler: str
    sampler: str
    #: KV blocks requests can hold (a reserved null block not counted)
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    #: with ``--enable-lora``: the modules adapters may change and their shapes, against
    #: which the front-end checks adapters (``chassis.core.lora.adapter.check_adapter``)
    lora_target_shapes: dict[str, tuple[int, int]] | None = None
    #: the sliding window (tokens) behind which the KV cache manager releases each request's
    #: blocks (every attention layer has one); None: requests keep every position
    kv_cache_window: int | None = None
    #: the window of each KV cache group (None: full attention); several when the model
    #: mixes sliding-window and full layers (each group's blocks released by its window)
    kv_cache_group_windows: tuple[int | None, ...] = (None,)
    #: whether steps are scheduled asynchronously (``--async-scheduling`` resolved: its
    #: default depends on the platform, ``core/async_scheduling_default.py``)
    async_scheduling: bool = False

    @property
    def kv_capacity_tokens(self) -> int:
        """Token positions the KV blocks hold at once (``num_kv_blocks * block_size``, the
        usable blocks, the null block not counted). With :attr:`kv_cache_window` a request
        keeps only about its window's positions in them, so the requests' total length may
        exceed it. With several KV cache groups a position takes a block in every group, so
        the blocks are divided among the groups (as vLLM reports it); window groups keep only
        their window's blocks, so the total may exceed this too."""
        return self.num_kv_blocks // len(self.kv_cache_group_windows) * self.block_size


def _window_note(
    kv_window: int | None,
    group_windows: tuple[int | None, ...],
    group_chunks: tuple[int | None, ...] = (),
) -> str:
    """What the start-up line says of the blocks sliding windows (and attention chunks)
    release."""
    if len(group_windows) > 1:
        chunks = group_chunks or (None,) * len(group_windows)
        kinds = [
            f"chunk {c}" if c is not None else "full" if w is None else str(w)
            for w, c in zip(group_windows, chunks, strict=True)
        ]
        return (
            f"; {len(group_windows)} KV cache groups of layers (windows {', '.join(kinds)}): "
            "a position takes a block in each group, but a window (or chunk) group holds only "
            "its window's (current chunk's) blocks, so the total over requests may exceed this"
        )
    if kv_window is None:
        return ""
    return (
        f"; every layer's sliding window is {kv_window} tokens, so each request holds only "
        f"its last ~{kv_window} tokens' blocks and the total over requests may exceed this"
    )


class EngineCore:
    """Schedules requests and runs steps. Built from a finalized ``EngineConfig``.

    One step reads like ARCHITECTURE section 2: ``scheduler.schedule()`` ->
    ``executor.execute_model_async()`` -> ``scheduler.update_from_output()`` with the result.
    Requests with structured outputs add one stage between planning and execution: their
    allowed tokens go with the plan (``SchedulerOutput.allowed_token_masks``).

    With ``config.async_scheduling`` a step launches plan N+1 before it collects the results
    of plan N, so the host plans and prepares while the device computes; each step then
    returns the outputs of the plan before it (see docs/scheduling.md).
    """

    def __init__(self, config: EngineConfig) -> None:
        from chassis.platforms import get_current_platform
        from chassis.plugins import get_registries, load_general_plugins

        load_general_plugins()
        self.config = config
        #: a pooling engine's pooling (prefix caching turned off where it cannot serve it)
        self.pooler_config = apply_pooling_defaults(config)
        scheduler_cls = get_registries().schedulers.get(config.scheduler)
        if self.pooler_config is not None and not scheduler_cls.supports_pooling:
            # (checked before the model loads) its requests would run but never finish
            raise ValueError(
                f"scheduler {config.scheduler!r} does not finish pooling requests (its "
                "supports_pooling is False): --runner pooling needs a scheduler built on "
                "ContinuousBatchingScheduler, such as fcfs or priority"
            )
        if config.async_scheduling is True and not scheduler_cls.supports_async_scheduling:
            # (checked before the model loads; the default, None, just resolves to off)
            raise ValueError(
                f"scheduler {config.scheduler!r} does not support --async-scheduling "
                "(its supports_async_scheduling is False); drop the flag or use a scheduler "
                "built on ContinuousBatchingScheduler"
            )
        platform = get_current_platform()
        # None ("auto") becomes a bool here, before anything downstream reads it
        config.async_scheduling = resolve_async_scheduling(config, platform, scheduler_cls)
        self.executor = make_executor(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        group_windows = self.executor.kv_cache_group_windows()
        group_chunks = self.executor.kv_cache_group_chunks()
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            group_windows=group_windows,
            group_chunks=group_chunks,
        )
        self.scheduler = scheduler_cls(config, self.kv_cache_manager)
        #: the plan launched by the last async step, whose results are not collected yet
        self._in_flight: tuple[SchedulerOutput, PendingRunnerOutput] | None = None
        self.structured_outputs = StructuredOutputManager(config)
        #: outputs of requests refused after they reached the engine, sent with the next step
        #: (and those of a plan async scheduling left in flight when the engine went to sleep)
        self._refused: list[EngineCoreOutput] = []
        #: the model class's supported modalities and name, read at the first request with
        #: images (:meth:`_model_modalities`)
        self._mm_model: tuple[frozenset[str], str] | None = None
        #: whether the model's image tokens attend to each other both ways (read with
        #: ``_mm_model``): requests then carry ``bidirectional_blocks`` for the scheduler
        self._mm_blocks = False
        #: LoRA: the adapter id of every accepted request with one, and each adapter's count
        #: of such requests; an adapter stays pinned in the workers' host memory while its
        #: count is above zero (``Executor.pin_lora``), so no step reads its folder
        self._lora_of: dict[str, int] = {}
        self._lora_refs: dict[int, int] = {}
        #: the folder each adapter id was first accepted with; the id keeps it for the
        #: engine's lifetime, as device slots and prefix-cache entries are keyed by the id
        self._lora_paths: dict[int, str] = {}
        #: what sleeps (sleep mode, ``--enable-sleep-mode``)
        self._sleep = SleepState()
        #: paused generation (``pause``/``resume``) and the requests held meanwhile
        self._pause = PauseState()
        #: the ids of the requests the scheduler holds (what a pause or sleep may abort)
        self._live: set[str] = set()
        #: why the last sleep that waited for requests to finish failed (``None``: it did not)
        self._sleep_error: str | None = None
        assert config.max_model_len is not None and config.attention_backend is not None
        self.info = EngineInfo(
            platform=platform.name,
            attention_backend=config.attention_backend,
            scheduler=config.scheduler,
            sampler=config.sampler,
            num_kv_blocks=self.kv_cache_manager.num_usable_blocks,
            block_size=config.block_size,
            kv_cache_window=self.kv_cache_manager.sliding_window,
            kv_cache_group_windows=group_windows,
            max_model_len=config.max_model_len,
            lora_target_shapes=self.executor.lora_target_shapes(),
            async_scheduling=config.async_scheduling,
        )
        logger.info(
            "engine core ready: platform=%s attention=%s scheduler=%s async_scheduling=%s "
            "KV cache %d blocks (%d tokens)%s",
            platform.name,
            config.attention_backend,
            config.scheduler,
            config.async_scheduling,
            self.info.num_kv_blocks,
            self.info.kv_capacity_tokens,
            _window_note(self.info.kv_cache_window, group_windows, group_chunks),
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. One the engine core cannot serve finishes at the next step with
        reason ``abort`` and ``EngineCoreOutput.error`` saying why (the error is logged too;
        the engine keeps serving): its structured-output constraint does not compile (or
        exceeded its work budget at an earlier request's first mask: remembered), it is
        of the other kind than the engine runs (pooling or generate; the front-end checks
        both first, so this is rare), its LoRA adapter id was accepted before with another
        folder (these three are the request's fault), or the engine's: the structured-output
        backend cannot be built or fails to compile with an unexpected error, or the workers
        cannot read its adapter any more (its folder deleted or changed since the front-end's
        check, and not held in host memory). A request with images the engine cannot serve
        is refused too, as the request's fault (:mod:`chassis.core.multimodal_admission`).
        While generation is paused the request is held, and added when the pause is lifted
        (:mod:`chassis.core.pause_state`)."""
        if self._pause.paused:
            self._pause.hold(request)
            return
        engine_request = Request.from_engine_core_request(request)
        lora = request.lora_request if self.config.enable_lora else None
        error: RequestError | None = None
        #: what the log says of an engine fault: the whole error (clients get its type)
        detail: str | None = None
        matcher = None
        if self._sleep.is_sleeping:  # nothing to run it with: the front-ends check first
            error = RequestError(message=sleeping_message(self._sleep.asleep), engine_sleeping=True)
        elif (request.pooling_params is not None) != (self.pooler_config is not None):
            error = RequestError(
                message=f"a {'pooling' if request.pooling_params else 'generate'} request "
                f"reached an engine with runner={self.config.runner!r}",
                client_error=True,
            )
        elif request.mm_features and (
            refusal := multimodal_refusal(
                self.config,
                len(request.prompt_token_ids),
                request.mm_features,
                *self._model_modalities(),
                bidirectional_blocks=self._mm_blocks,
            )
        ):
            error = RequestError(message=refusal, client_error=True)
        else:
            try:
                matcher = self.structured_outputs.matcher_for(engine_request)
            except StructuredOutputsUnavailable as exc:  # the backend's fault
                detail = str(exc)  # (the manager logged its traceback)
                error = engine_fault(
                    "structured output: the engine cannot serve the constraint",
                    exc.__cause__ or exc,
                )
            except ValueError as exc:  # the constraint's fault
                error = RequestError(message=str(exc), client_error=True)
        if error is None and lora is not None:
            # last: nothing above needs undoing once it is pinned
            error = self._pin_lora(request.request_id, lora)
        if error is not None:
            logger.error("request %s refused: %s", request.request_id, detail or error.message)
            self._refused.append(
                EngineCoreOutput(
                    request_id=request.request_id, finish_reason=FinishReason.ABORT, error=error
                )
            )
            return
        if request.mm_features and self._mm_blocks:  # (read by the multimodal_refusal above)
            engine_request.bidirectional_blocks = [(f.offset, f.end) for f in request.mm_features]
        try:
            self.scheduler.add_request(engine_request)
        except BaseException:
            self._unpin_lora(request.request_id)
            raise
        self._live.add(request.request_id)
        if matcher is not None:  # only once the scheduler has the request
            params = request.sampling_params.structured_outputs
            assert params is not None
            self.structured_outputs.track(
                request.request_id,
                request.prompt_token_ids,
                matcher,
                params.after_reasoning,
                params.cache_key(),
            )

    def _model_modalities(self) -> tuple[frozenset[str], str]:
        """The model class's ``supported_modalities`` and name (read once, when the first
        request with images arrives: text-only engines never ask)."""
        if self._mm_model is None:
            from chassis.core.model_loader import engine_hf_config, model_class

            cls = model_class(engine_hf_config(self.config))
            self._mm_model = (cls.supported_modalities, cls.__name__)
            self._mm_blocks = bool(getattr(cls, "bidirectional_image_blocks", False))
        return self._mm_model

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self._live.difference_update(request_ids)
        self._pause.drop_held(set(request_ids))
        self.scheduler.abort(request_ids)
        self.structured_outputs.finish(request_ids)
        for request_id in request_ids:
            self._unpin_lora(request_id)

    def _pin_lora(self, request_id: str, lora: LoRARequest) -> RequestError | None:
        """Count ``request_id`` as a user of ``lora``, pinning it in the workers on its first;
        or, leaving nothing pinned, return why the request is refused: the id was accepted
        before with another folder (the request's fault), or the workers cannot read its
        folder (the engine's: the front-end read it when it checked the request)."""
        lora_id = lora.lora_int_id
        bound = self._lora_paths.get(lora_id)
        if bound is not None and bound != lora.lora_path:
            # the front-end refuses this first; a request that skipped it (an embedder of
            # EngineCore) must not run the adapter already pinned or cached under the id
            return RequestError(
                message=f"LoRA adapter id {lora_id} belongs to the adapter in {bound}; adapter "
                f"{lora.lora_name!r} in {lora.lora_path} cannot take it: give each adapter "
                "its own id",
                client_error=True,
            )
        count = self._lora_refs.get(lora_id, 0)
        if count == 0:
            try:
                self.executor.pin_lora(lora)
            except ValueError as exc:
                return RequestError(
                    message=f"LoRA adapter {lora.lora_name!r} (id {lora_id}) cannot be loaded "
                    f"from {lora.lora_path}: {exc}"
                )
        self._lora_paths[lora_id] = lora.lora_path
        self._lora_refs[lora_id] = count + 1
        self._lora_of[request_id] = lora_id
        return None

    def _unpin_lora(self, request_id: str) -> None:
        """``request_id`` finished: unpin its adapter after its last request (a request
        without one, or already counted out, is ignored)."""
        lora_id = self._lora_of.pop(request_id, None)
        if lora_id is None:
            return
        count = self._lora_refs.pop(lora_id) - 1
        if count:
            self._lora_refs[lora_id] = count
        else:
            self.executor.unpin_lora(lora_id)

    def has_unfinished(self) -> bool:
        """Whether a step has something to do: a request is waiting or running (and not
        frozen by ``pause(mode="keep")``), a launched step awaits collection, or outputs
        wait to be sent."""
        runnable = self.scheduler.has_unfinished() and not self._pause.frozen
        return runnable or self._in_flight is not None or bool(self._refused)

    def step(self) -> EngineCoreOutputs:
        """Run one scheduling + execution step and return what requests produced.

        An empty plan (e.g. only aborts to report) still goes to the executor, which drops the
        finished requests from its batch. With async scheduling the plan launched here is
        collected by the next step, and this step collects the one before.
        """
        outputs, self._refused = self._refused, []
        if self._pause.frozen:  # pause(mode="keep"): nothing runs until resume()
            return EngineCoreOutputs(
                outputs=outputs, timestamp=time.time(), stats=self.scheduler.stats()
            )
        scheduler_output = self.scheduler.schedule()
        if self.structured_outputs.has_constrained(scheduler_output):
            if self._in_flight is not None:
                # A mask depends on every token before it: collect the step in flight first
                # (async scheduling pauses for plans with constrained requests).
                outputs += self._collect(*self._in_flight)
                self._in_flight = None
            scheduler_output.allowed_token_masks = self.structured_outputs.masks_for(
                scheduler_output
            )
            # A request whose mask could not be computed leaves the plan before it runs (as
            # an abort arriving while a plan is in flight: the runner's result is dropped).
            outputs += self._fail_constrained([])
        pending = self.executor.execute_model_async(scheduler_output)
        to_collect = None if scheduler_output.is_empty else (scheduler_output, pending)
        if self.config.async_scheduling:
            # The device computes this plan while the host collects the previous one.
            to_collect, self._in_flight = self._in_flight, to_collect
        if to_collect is not None:
            outputs += self._collect(*to_collect)
        self._finish_drain()
        outputs, self._refused = outputs + self._refused, []  # (held requests it refused)
        return EngineCoreOutputs(
            outputs=outputs, timestamp=time.time(), stats=self.scheduler.stats()
        )

    def _collect(
        self, plan: SchedulerOutput, result: PendingRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The outputs of a launched plan, once its results are in."""
        outputs = self.scheduler.update_from_output(plan, result.result())
        self.structured_outputs.update(outputs)
        outputs += self._fail_constrained(outputs)
        self._live.difference_update(out.request_id for out in outputs if out.finished)
        if self._lora_of:
            for out in outputs:
                if out.finished:
                    self._unpin_lora(out.request_id)
        return outputs

    def _fail_constrained(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Finish, with reason ``abort`` and their error, the requests whose structured-output
        matcher raised (``StructuredOutputManager.take_failures``); the other requests go on.
        A failed request's output among ``outputs`` (this step's) is changed in place;
        returns the outputs to add for the others."""
        failures = self.structured_outputs.take_failures()
        if not failures:
            return []
        self.scheduler.abort(failures)  # (ids it has finished already are ignored)
        by_id = {out.request_id: out for out in outputs}
        added = []
        for request_id, error in failures.items():
            self._unpin_lora(request_id)
            self._live.discard(request_id)
            out = by_id.get(request_id)
            if out is None:
                added.append(
                    EngineCoreOutput(
                        request_id=request_id, finish_reason=FinishReason.ABORT, error=error
                    )
                )
            else:
                out.finish_reason, out.stop_reason, out.error = FinishReason.ABORT, None, error
        return added

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: later requests compute their prompts from scratch
        until their blocks are cached again (vLLM's ``reset_prefix_cache``, used to measure
        with a cold cache). Running requests keep their blocks and outputs. Always succeeds
        (``True``; vLLM refuses, ``False``, while any block is in use: here only the hashes
        are dropped, which is safe with blocks in use); a no-op without prefix caching."""
        dropped = self.kv_cache_manager.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", dropped)
        return True

    # -- sleep mode (core/sleep_mode.py; docs/serving.md, "Sleep mode") --------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> list[str]:
        """Free the KV cache (forgetting the prefix cache) and, at level 1, move the weights
        to host memory or, at level 2, discard them, on every worker. Returns the parts
        asleep.

        ``mode`` says what happens to unfinished requests first (vLLM's): ``"abort"``
        finishes them now with reason ``abort``; ``"wait"`` holds new requests and lets
        them finish, and the sleep runs in the step that finishes the last one (returns
        ``[]`` until then: :meth:`sleep_progress`); ``"keep"`` sleeps only when none is
        unfinished (:class:`EngineBusyError` otherwise: their KV cache would be lost).
        ``ValueError`` without ``--enable-sleep-mode``, for another level or mode.
        Sleeping again while asleep (or while a sleep waits) does nothing (a warning), as
        vLLM; :meth:`wake_up` before a waiting sleep ran cancels it."""
        check_sleep_mode_enabled(self.config)
        level = check_sleep_level(level)
        mode = check_pause_mode(mode)
        if not self._sleep.to_sleep(level):
            return sorted(self._sleep.asleep)
        if self._pause.sleep_after_drain is not None:
            logger.warning("sleep(%d) ignored: a sleep waits for requests to finish", level)
            return []
        if mode == "abort":
            self._abort_unfinished("the engine goes to sleep")
        stats = self.scheduler.stats()
        unfinished = stats.num_running + stats.num_waiting
        if not unfinished and self._in_flight is not None:
            # async scheduling: the last plan (of requests that have finished since) is still
            # in flight; collect it now, its outputs go out with the next step
            self._refused += self._collect(*self._in_flight)
            self._in_flight = None
        if unfinished and mode == "keep":
            raise EngineBusyError(
                f"cannot sleep with mode 'keep' while {unfinished} request(s) are unfinished "
                "(sleeping frees their KV cache): sleep with mode 'abort' or 'wait', or let "
                "them finish first"
            )
        if unfinished and self._pause.frozen:
            raise EngineBusyError(
                f"cannot sleep with mode 'wait': generation is paused with mode 'keep', so "
                f"its {unfinished} request(s) never finish; resume first, or sleep with mode "
                "'abort'"
            )
        if unfinished:
            self._pause.sleep_after_drain = level
            self._sleep_error = None
            logger.info(
                "sleep(%d) waits for %d unfinished request(s); new requests are held",
                level,
                unfinished,
            )
            return []
        self._sleep_now(level)
        return sorted(self._sleep.asleep)

    def _sleep_now(self, level: int) -> None:
        # first: the blocks' contents are gone after the sleep, and also after a failed
        # one (the workers then bring back zeroed caches)
        dropped = self.kv_cache_manager.reset_prefix_cache()
        self.executor.sleep(level)
        self._sleep.slept(level)
        logger.info("sleeping at level %d (%d cached prefix blocks forgotten)", level, dropped)

    def sleep_progress(self) -> list[object]:
        """``[waiting, asleep, error]``: whether a ``sleep(mode="wait")`` still waits for
        requests to finish, the parts asleep (sorted), and why the last such sleep failed
        once drained (``None``: it did not)."""
        waiting = self._pause.sleep_after_drain is not None
        return [waiting, sorted(self._sleep.asleep), self._sleep_error]

    def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Bring back the parts ``tags`` names (``"weights"``, ``"kv_cache"``; ``None``:
        both) on every worker; weights discarded at level 2 are loaded from the checkpoint
        again. Returns the parts still asleep; the engine serves again once none is.
        ``ValueError`` without ``--enable-sleep-mode`` or for an unknown tag. Parts that are
        awake are skipped (a warning)."""
        check_sleep_mode_enabled(self.config)
        wanted = self._sleep.to_wake(check_wake_tags(tags))
        pause = self._pause
        if pause.sleep_after_drain is not None:
            # a sleep(mode="wait") still waiting: woken before it ran, it will not run (its
            # caller's poll sees it gone); the requests it held go on unless a pause remains
            logger.info("wake_up: the sleep waiting for requests to finish is cancelled")
            pause.sleep_after_drain = None
            for request in pause.take_held():
                self.add_request(request)
        if wanted:
            self.executor.wake_up(list(wanted))
            self._sleep.woke(wanted)
        return sorted(self._sleep.asleep)

    def is_sleeping(self) -> bool:
        """Whether any part (weights or KV cache) is asleep; ``False`` without sleep mode."""
        return self._sleep.is_sleeping

    def sleeping_tags(self) -> list[str]:
        """The parts asleep (``"kv_cache"``, ``"weights"``), sorted; empty when awake."""
        return sorted(self._sleep.asleep)

    # -- pausing generation (core/pause_state.py; docs/serving.md, "Pausing generation") ---

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> bool:
        """Stop starting requests until :meth:`resume` (vLLM's ``pause_generation``):
        requests that arrive meanwhile are held. ``mode`` says what happens to the
        unfinished ones (:data:`~chassis.core.pause_state.PAUSE_MODES`): ``"abort"``
        finishes them now (reason ``abort``), ``"wait"`` lets them finish, ``"keep"``
        freezes them. With ``clear_cache`` (not for ``"keep"``) the prefix cache is
        forgotten once they are done. Returns whether they are done (always, but for
        ``"wait"`` with requests running: then :meth:`pause_drained` says when).
        ``ValueError`` for another mode; :class:`EngineBusyError` for ``"keep"`` while a
        ``"wait"`` pause or sleep still waits (frozen, its requests would never finish).
        Pausing a paused engine applies the new mode."""
        mode = check_pause_mode(mode)
        pause = self._pause
        if mode == "keep" and pause.waiting_for_drain and self.scheduler.has_unfinished():
            # frozen, the requests a waiting pause or sleep waits for would never finish
            waiting = "a sleep" if pause.sleep_after_drain is not None else "a pause"
            raise EngineBusyError(
                f"cannot pause with mode 'keep': {waiting} with mode 'wait' is waiting for "
                "the unfinished requests to finish; wait for it, or pause with mode 'abort'"
            )
        pause.explicit, pause.mode = True, mode
        if mode == "abort":
            self._abort_unfinished("generation is paused")
        elif mode == "keep" and self._in_flight is not None:
            # the plan in flight finishes (its tokens go out with the next step); no other
            self._refused += self._collect(*self._in_flight)
            self._in_flight = None
        pause.draining = mode != "keep"
        pause.clear_cache_on_drain = clear_cache and mode != "keep"
        logger.info("generation paused (mode %s)", mode)
        self._finish_drain()
        return not pause.draining

    def pause_drained(self) -> bool:
        """Whether the requests a ``pause(mode="wait")`` waits for have finished (``True``
        when no pause waits)."""
        return not self._pause.draining

    def resume(self) -> None:
        """Lift :meth:`pause`: frozen requests go on, held requests are added in their
        order (refused then as any request, e.g. while asleep). Not paused: nothing to do."""
        pause = self._pause
        if not pause.explicit:
            return
        pause.explicit, pause.mode, pause.draining = False, None, False
        held = pause.take_held()
        logger.info("generation resumed (%d held request(s) added)", len(held))
        for request in held:
            self.add_request(request)

    def is_paused(self) -> bool:
        """Whether arriving requests are held: :meth:`pause` was called and not
        :meth:`resume`, or a ``sleep(mode="wait")`` waits for requests to finish."""
        return self._pause.paused

    def _abort_unfinished(self, why: str) -> None:
        """Finish every request the scheduler holds with reason ``abort`` (their outputs
        go out with the next step), after collecting the plan in flight."""
        if self._in_flight is not None:
            self._refused += self._collect(*self._in_flight)
            self._in_flight = None
        request_ids = sorted(self._live)
        if not request_ids:
            return
        self.abort_requests(request_ids)
        self._refused += [
            EngineCoreOutput(request_id=request_id, finish_reason=FinishReason.ABORT)
            for request_id in request_ids
        ]
        logger.info("%d unfinished request(s) aborted: %s", len(request_ids), why)

    def _finish_drain(self) -> None:
        """Once the requests a pause or a sleep waits for are done: forget the prefix
        cache (``clear_cache``), run the waiting sleep, and add the held requests when
        nothing pauses the engine any more."""
        pause = self._pause
        if not pause.waiting_for_drain:
            return
        if self.scheduler.has_unfinished() or self._in_flight is not None:
            return
        if pause.draining:
            pause.draining = False
            if pause.clear_cache_on_drain:
                self.kv_cache_manager.reset_prefix_cache()
        if pause.sleep_after_drain is not None:
            level, pause.sleep_after_drain = pause.sleep_after_drain, None
            try:
                self._sleep_now(level)
            except Exception as exc:  # the waiting caller is told (sleep_progress)
                logger.exception("sleep(%d), run once its requests finished, failed", level)
                self._sleep_error = f"{type(exc).__name__}: {exc}"
            for request in pause.take_held():
                self.add_request(request)

    def check_health(self) -> None:
        """Raise if the engine cannot run steps any more (a tensor-parallel rank died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
