"""``ServerState``: what every route shares (engine, renderer, metrics, in-flight requests).

The engine is anything that fulfils the ``AsyncLLM`` contract of
:mod:`chassis.core.async_llm`; the server uses exactly this part of it::

    engine.config.max_model_len: int       # resolved by the engine
    engine.config.chat_template: str|None  # the --chat-template value
    engine.tokenizer                       # a transformers tokenizer (encode/decode/__len__)
    engine.model_name: str                 # the name clients must send as "model"
    engine.generate(prompt: str | list[int], sampling_params, request_id, *,
                    priority=0, delta=True) -> AsyncIterator[RequestOutput]
        # and lora_request=LoRARequest, passed only for a request naming an adapter,
        # cache_salt=str, only for a request that sends one, and multi_modal_data=
        # {"image": [PIL images]} (with mm_processor_kwargs=dict when sent), only for a
        # chat or Responses request with images
        # ValueError (bad input) from the first __anext__, before anything is yielded;
        # EngineDeadError when the engine core is dead; closing or cancelling the iterator
        # aborts the request in the engine (frees its KV blocks); with n > 1 one
        # RequestOutput carries deltas for several completions (outputs[i].index).
    await engine.abort(request_id)         # end a request early (on SIGTERM); its stream
                                           # then raises CancelledError (handled here)
    engine.errored: bool; engine.dead_error: EngineDeadError | None
    await engine.check_health()            # raises EngineDeadError
    engine.stats() -> SchedulerStats       # latest scheduler snapshot (for /metrics)
    engine.engine_stats() -> list[SchedulerStats]  # optional: each engine core's snapshot
                                           # (/metrics' engine label; else [stats()])
    engine.add_dead_callback(cb)           # cb() once, on the event loop, when the core dies
    await engine.shutdown()
    engine.input_processor.check_lora(lora_request)  # only with LoRA adapters: ValueError
                                           # for an adapter the engine cannot run
    await engine.check_request(prompt, sampling_params, *, priority=0)  # optional (and
        # lora_request, cache_salt, multi_modal_data, mm_processor_kwargs as generate's):
        # generate's refusals (ValueError, EngineDeadError) without submitting the request
    await engine.reset_prefix_cache()      # only in development mode (POST
                                           # /reset_prefix_cache); EngineDeadError
    await engine.sleep(level, mode)        # only in development mode (POST /sleep,
    await engine.wake_up(tags)             # /wake_up, GET /is_sleeping): sleep mode;
    await engine.is_sleeping()             # ValueError without it, EngineBusyError
    await engine.pause_generation(mode=, clear_cache=)  # only in development mode (POST
    await engine.resume_generation()       # /pause, /resume, GET /is_paused);
    await engine.is_paused()               # ValueError for a bad mode
    engine.engine_info                     # optional, development mode's /server_info:
                                           # the engine core's start-up report
    engine.engine_infos                    # optional, there too: every engine core's
                                           # (several with --data-parallel-size)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chassis.serve import errors
from chassis.serve.chat_parsing import ChatParsers
from chassis.serve.lora import LoRAAdapters, engine_lora_check
from chassis.serve.protocol import PromptLogprob, PromptLogprobs, UsageInfo
from chassis.serve.request_log import output_log
from chassis.serve.streaming import prepend

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.outputs import RequestOutput
    from chassis.core.sampling_params import SamplingParams
    from chassis.serve.metrics import ServerMetrics
    from chassis.serve.renderer import ChatRenderer
    from chassis.serve.settings import ServerSettings

logger = logging.getLogger(__name__)


def optional_generate_kwargs(
    lora_request: LoRARequest | None,
    cache_salt: str | None,
    multi_modal_data: dict[str, Any] | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``engine.generate`` keywords beyond the contract's first ones, only those that are
    set: an engine without LoRA adapters, cache salts or images keeps serving requests that
    use none."""
    kwargs: dict[str, Any] = {}
    if lora_request is not None:
        kwargs["lora_request"] = lora_request
    if cache_salt is not None:
        kwargs["cache_salt"] = cache_salt
    if multi_modal_data is not None:
        kwargs["multi_modal_data"] = multi_modal_data
        if mm_processor_kwargs is not None:
            kwargs["mm_processor_kwargs"] = mm_processor_kwargs
    return kwargs


@dataclass
class ServerState:
    """Shared by all routes of one app (``app.state.chassis``)."""

    engine: Any
    settings: ServerSettings
    renderer: ChatRenderer
    metrics: ServerMetrics
    #: the reasoning and tool-call parsers of ``--reasoning-parser`` / ``--tool-call-parser``
    parsers: ChatParsers = field(default_factory=ChatParsers)
    #: sampling values a request leaves unset take from here (the model's
    #: generation_config.json, core/generation_defaults.py)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: the LoRA adapters requests may name as ``model`` (``--lora-modules``, loaded ones)
    loras: LoRAAdapters = field(init=False)
    #: engine request ids currently generating (aborted on shutdown)
    inflight: set[str] = field(default_factory=set)
    shutting_down: bool = False
    #: in-flight ids the server aborted itself
    _aborted: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.loras = LoRAAdapters(
            self.model_name, engine_lora_check(self.engine), self.settings.served_model_aliases
        )

    @property
    def model_name(self) -> str:
        """The name answers and /metrics carry (the first ``--served-model-name``)."""
        return self.engine.model_name

    @property
    def model_names(self) -> list[str]:
        """Every name a request may send for the served model: :attr:`model_name`, then the
        settings' ``served_model_aliases`` (vLLM's several ``--served-model-name``)."""
        names = [self.model_name]
        names += [n for n in self.settings.served_model_aliases if n not in names]
        return names

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.engine.config, "max_model_len", None)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def token_text(self, token_id: int, decoded: str | None = None, *, as_id: bool = False) -> str:
        """The text of one token for logprobs (the engine's decoding when it sent one); with
        ``as_id``, vLLM's ``"token_id:ID"`` instead (``--return-tokens-as-token-ids``)."""
        if as_id:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether a request's logprobs name tokens by id: its own
        ``return_tokens_as_token_ids``, else the server's flag."""
        if requested is not None:
            return requested
        return self.settings.return_tokens_as_token_ids

    def usage_counter(self) -> UsageCounter:
        """A request's :class:`UsageCounter`, reporting cached prompt tokens as the server
        is set to (``--enable-prompt-tokens-details``)."""
        return UsageCounter(prompt_tokens_details=self.settings.enable_prompt_tokens_details)

    def prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of an output, or ``None`` when it has none."""
        if output.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for position in output.prompt_logprobs:
            if position is None:
                result.append(None)
                continue
            result.append(
                {
                    str(tid): PromptLogprob(
                        logprob=lp.logprob,
                        rank=lp.rank,
                        decoded_token=self.token_text(tid, lp.decoded_token),
                    )
                    for tid, lp in position.items()
                }
            )
        return result

    # -- checks -------------------------------------------------------------------------------

    def check_model(self, requested: str | None) -> str:
        """The name to answer with: the served name (:attr:`model_name`) for ``None`` or any
        of :attr:`model_names`, as vLLM answers; ``requested`` when it is an adapter's; a
        404 for any other name."""
        return self.resolve_model(requested)[0]

    def resolve_model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """:meth:`check_model`, with the adapter ``requested`` names (``None``: the base
        model)."""
        if requested is None or requested in self.model_names:
            return self.model_name, None
        lora = self.loras.get(requested)
        if lora is not None:
            return requested, lora
        served = ", ".join(f"'{name}'" for name in self.model_names)
        names = [f"'{adapter.lora_name}'" for adapter in self.loras]
        if names:
            served += f" and the LoRA adapter{'s' if len(names) > 1 else ''} {', '.join(names)}"
        raise errors.APIError(
            404,
            f"The model '{requested}' does not exist. This server serves {served} "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )

    def check_accepting(self) -> None:
        """A 503 when the server is shutting down or the engine is dead."""
        if self.shutting_down:
            raise errors.shutting_down()
        if self.engine.errored:
            raise errors.engine_dead(self.engine.dead_error)

    # -- generation ---------------------------------------------------------------------------

    async def _tracked(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None,
        cache_salt: str | None,
        multimodal: dict[str, Any],
    ) -> AsyncIterator[RequestOutput]:
        tracker = self.metrics.tracker(params.n)
        self.inflight.add(request_id)
        failed = False  # refused (400) or engine death: not an abort by the client
        extras = optional_generate_kwargs(lora_request, cache_salt, **multimodal)
        outputs_log = output_log(self.settings, request_id)
        try:
            stream = self.engine.generate(
                prompt, params, request_id, priority=priority, delta=True, **extras
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    tracker.observe(output)
                    if outputs_log is not None:
                        outputs_log.observe(output)
                    yield output
        except asyncio.CancelledError:
            # AsyncLLM.abort() ends the request's stream by raising CancelledError in it. When
            # the server itself aborted the request (shutdown) and this task is not being
            # cancelled, end the stream quietly: the routes report finish_reason "abort".
            task = asyncio.current_task()
            if request_id in self._aborted and (task is None or not task.cancelling()):
                return
            raise
        except Exception:
            failed = True
            raise
        finally:
            if not failed:
                tracker.close()
            self.inflight.discard(request_id)
            self._aborted.discard(request_id)

    async def open_stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        *,
        multi_modal_data: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Start one request (with the LoRA adapter ``lora_request``, ``None``: the base
        model, the prefix-cache salt ``cache_salt``, and the prompt's images
        ``multi_modal_data``) and wait for its first output.

        Invalid input surfaces here (a 400 ``APIError``; a dead engine a 503) before any
        response byte is sent. The returned stream yields the first output again, then the
        rest; close it (``aclosing``) to abort the request.
        """
        multimodal = {
            "multi_modal_data": multi_modal_data,
            "mm_processor_kwargs": mm_processor_kwargs,
        }
        stream = self._tracked(
            prompt, params, request_id, priority, lora_request, cache_salt, multimodal
        )
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return _empty()
        except Exception as exc:
            await stream.aclose()
            raise errors.to_api_error(exc) from exc
        except BaseException:
            await stream.aclose()
            raise
        return prepend(first, stream)

    async def check_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        *,
        multi_modal_data: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """The engine's refusals of this request (``engine.check_request``: its input
        processor's checks, the prompt's length against the context with its images
        expanded, the sampling values, the constraint, the adapter, ...) without starting
        it: the same 400 (or 503) ``APIError`` :meth:`open_stream` would raise. For a
        request answered before it starts (a background response). Nothing to do for an
        engine without the check."""
        check = getattr(self.engine, "check_request", None)
        if check is None:
            return
        extras = optional_generate_kwargs(
            lora_request, cache_salt, multi_modal_data, mm_processor_kwargs
        )
        try:
            await check(prompt, params, priority=priority, **extras)
        except Exception as exc:
            raise errors.to_api_error(exc) from None

    async def open_streams(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """:meth:`open_stream` for a batch (ids ``{request_id}-{i}``); all or none."""
        if len(prompts) == 1:
            return [
                await self.open_stream(
                    prompts[0], params, request_id, priority, lora_request, cache_salt
                )
            ]
        tasks = [
            asyncio.ensure_future(
                self.open_stream(p, params, f"{request_id}-{i}", priority, lora_request, cache_salt)
            )
            for i, p in enumerate(prompts)
        ]
        opened = False
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            opened = True
            return [task.result() for task in tasks]
        finally:
            if not opened:  # one failed, or we were cancelled: close what did open
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for task in tasks:
                    if not task.cancelled() and task.exception() is None:
                        await task.result().aclose()  # type: ignore[attr-defined]

    async def abort_all(self) -> None:
        """Abort every in-flight request (shutdown): their streams end with ``abort``."""
        for request_id in list(self.inflight):
            self._aborted.add(request_id)
            try:
                await self.engine.abort(request_id)
            except Exception as exc:  # the engine may be gone already
                logger.debug("abort of %s failed: %s", request_id, exc)


class UsageCounter:
    """Token counts of one API request: prompts (counted once per prompt) and completions.

    ``prompt_tokens_details`` off: the usage's ``prompt_tokens_details`` is null (vLLM's
    default), else it holds the prefix-cache hits, ``cached_tokens``.
    """

    def __init__(self, *, prompt_tokens_details: bool = True) -> None:
        self.with_details = prompt_tokens_details
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        # the engine's prompt (after truncate_prompt_tokens) replaces a count set earlier
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = max(
            self.cached_tokens.get(prompt_index, 0), output.num_cached_tokens or 0
        )
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo(**self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        """:meth:`info` as the plain dict its JSON is (streamed chunks skip the model)."""
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}
            if self.with_details
            else None,
        }


async def _empty() -> AsyncIterator[RequestOutput]:
    return
    yield  # pragma: no cover - makes this an async generator
