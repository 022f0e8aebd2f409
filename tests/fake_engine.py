"""A test double of the ``AsyncLLM`` contract, for testing the API server without a model.

``FakeAsyncLLM`` behaves like the real engine at its interface (see chassis.serve.state for
the contract): it validates like the input processor (empty prompt, context length, logprobs
limit -> ``ValueError`` from the first ``__anext__``), streams deltas for ``n`` completions,
honours ``max_tokens``, stop strings, logprobs and ``abort``, records what it was asked, and
can be killed (``kill()``) to test engine death. It has no ``input_processor`` (an engine
need not have one) unless a test sets one: ``FakeInputProcessor`` checks structured-output
constraints with the real backend's ``check``, at the start of every request and in
``check_request`` (the same validation, without starting the request).

Completion ``i`` of a request generates the letters ``"abcdefghijklmnopqrstuvwxyz"`` cyclically,
starting at letter ``i``, one byte-level token per letter, so outputs are predictable. With
``script`` set, every completion instead writes that text, one character per step, and then
stops as at EOS (finish reason ``stop``) unless ``max_tokens`` ends it first.

The tokenizer is a real ``transformers`` fast tokenizer built in memory (byte-level BPE without
merges: one token per UTF-8 byte, plus BOS/EOS/ChatML specials), so the renderer, /tokenize
and /detokenize run real code paths offline.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable

from chassis.core.config import EngineConfig
from chassis.core.errors import EngineDeadError
from chassis.core.input_processor import logprobs_over_limit
from chassis.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from chassis.core.request import SchedulerStats
from chassis.core.sampling_params import SamplingParams

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'forbidden' %}{{ raise_exception('role forbidden is not allowed') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))]
    )
    return tok.to_str()


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A fresh byte-level ``PreTrainedTokenizerFast`` (vocab 260) with a ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        chat_template=chat_template,
    )


class FakeInputProcessor:
    """The part of the engine's input processor the server may call on its own: the
    structured-output check, the engine's configured backend's own (real) ``check``. Set it
    as ``engine.input_processor`` to have the fake engine check constraints."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def check_structured_outputs(self, params: SamplingParams) -> None:
        from chassis.plugins.registries import get_registries

        assert params.structured_outputs is not None
        backend = get_registries().structured_output_backends.get(
            self.config.structured_output_backend
        )
        try:
            backend.check(params.structured_outputs)
        except ValueError as exc:  # worded as the engine's, so the server names the field
            raise ValueError(f"invalid sampling parameter structured_outputs: {exc}") from None


class FakeAsyncLLM:
    """Fulfils the AsyncLLM contract used by chassis.serve with deterministic outputs.

    ``token_delay`` seconds pass between steps; ``gate`` (an ``asyncio.Event`` created
    lazily in the running loop by :meth:`hold`) pauses every request after its first step (or
    its first ``after`` steps).
    """

    def __init__(
        self,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 256,
        max_logprobs: int = 20,
        token_delay: float = 0.0,
        chat_template: str | None = CHAT_TEMPLATE,
        config_chat_template: str | None = None,
        abort_mode: str = "cancel",
        script: str | None = None,
    ) -> None:
        self.tokenizer = make_tokenizer(chat_template)
        self.config = EngineConfig(
            model="/models/fake",
            served_model_name=model_name,
            max_model_len=max_model_len,
            max_logprobs=max_logprobs,
            chat_template=config_chat_template,
        )
        self.model_name = model_name
        self.token_delay = token_delay
        #: what abort() does to the stream: "cancel" raises CancelledError in it (as
        #: AsyncLLM does), "finish" yields a last output with finish_reason "abort"
        self.abort_mode = abort_mode
        #: the text every completion writes (None: the letters)
        self.script = script
        self.requests: list[tuple[str, list[int], SamplingParams, int]] = []
        #: the cache_salt of each generate call (None when not passed)
        self.cache_salts: list[str | None] = []
        #: requests whose stream was closed or cancelled before it finished
        self.aborted: list[str] = []
        #: ids passed to abort()
        self.abort_calls: list[str] = []
        self.finished: list[str] = []
        self.running: set[str] = set()
        self._abort_flags: set[str] = set()
        self._dead: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[], None]] = []
        self._held = False
        self._hold_after = 1
        self._release: asyncio.Event | None = None
        self.shutdown_calls = 0
        #: check_request calls (the server checks background responses before answering)
        self.checked = 0
        #: kill the engine when this many steps have run in total (None: never)
        self.die_after_steps: int | None = None
        self._steps = 0

    # -- test controls --------------------------------------------------------------------

    def hold(self, after: int = 1) -> None:
        """Pause every request after its first ``after`` outputs until :meth:`release`."""
        self._held = True
        self._hold_after = after

    def release(self) -> None:
        self._held = False
        if self._release is not None:
            self._release.set()

    def kill(self, reason: str = "engine core process exited (test)") -> None:
        """Die like the real engine: fail requests, fire the dead callbacks (on the loop)."""
        if self._dead is not None:
            return
        self._dead = EngineDeadError(reason)
        if self._release is not None:
            self._release.set()
        for cb in self._dead_callbacks:
            try:
                asyncio.get_running_loop().call_soon(cb)
            except RuntimeError:
                cb()

    # -- the AsyncLLM contract ------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def stats(self) -> SchedulerStats:
        if self._dead is not None:
            raise self._dead
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=0,
            kv_cache_usage=0.25,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions=1,
        )

    def add_dead_callback(self, cb: Callable[[], None]) -> None:
        self._dead_callbacks.append(cb)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        self._abort_flags.add(request_id)
        if self._release is not None:
            self._release.set()

    async def shutdown(self) -> None:
        self.shutdown_calls += 1

    def shutdown_sync(self) -> None:
        self.shutdown_calls += 1

    async def check_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """:meth:`generate`'s refusals without starting the request (``check_request`` of
        the contract); counted in :attr:`checked`."""
        self.checked += 1
        if self._dead is not None:
            raise self._dead
        self._validate(self._prompt_ids(prompt), sampling_params)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not prompt_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        assert limit is not None
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt is {len(prompt_ids)} tokens."
            )
        if params.max_tokens is None:
            params = params.clone(max_tokens=limit - len(prompt_ids))
        elif len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt_ids) + params.max_tokens} tokens."
            )
        for name in ("logprobs", "prompt_logprobs"):
            message = logprobs_over_limit(name, getattr(params, name), self.config.max_logprobs)
            if message is not None:
                raise ValueError(message)
        processor = getattr(self, "input_processor", None)  # set by tests that want it
        if params.structured_outputs is not None and processor is not None:
            processor.check_structured_outputs(params)
        return params

    def _logprobs(self, token_id: int, k: int) -> dict[int, Logprob]:
        """The sampled token (rank 1, logprob -0.5) and ``k`` alternatives "A", "B", ...;
        the alternatives carry no decoded text, so the server must decode them itself."""
        decoded = self.tokenizer.decode([token_id])
        out = {token_id: Logprob(logprob=-0.5, rank=1, decoded_token=decoded)}
        upper = [self.tokenizer.convert_tokens_to_ids(c) for c in LETTERS.upper()]
        for rank, alt in enumerate(upper[:k], start=2):
            out[alt] = Logprob(logprob=-float(rank), rank=rank, decoded_token=None)
        return out

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        delta: bool = True,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        self.cache_salts.append(cache_salt)
        prompt_ids = self._prompt_ids(prompt)
        params = self._validate(prompt_ids, sampling_params)
        self.requests.append((request_id, prompt_ids, params, priority))
        self.running.add(request_id)
        arrival = time.time()
        n = params.n
        texts = [""] * n
        counts = [0] * n
        done = [False] * n
        finished_cleanly = False
        try:
            step = 0
            while not all(done):
                if self._dead is not None:
                    raise self._dead
                if step > 0:
                    if self._held and step >= self._hold_after:
                        if self._release is None:
                            self._release = asyncio.Event()
                        self._release.clear()
                        await self._release.wait()
                        if self._dead is not None:
                            raise self._dead
                    await asyncio.sleep(self.token_delay)
                step += 1
                self._steps += 1
                if self.die_after_steps is not None and self._steps >= self.die_after_steps:
                    self.kill()
                    raise self._dead  # type: ignore[misc]
                aborted = request_id in self._abort_flags
                if aborted and self.abort_mode == "cancel":
                    # what AsyncLLM does: abort() ends the stream with CancelledError
                    raise asyncio.CancelledError(f"request {request_id} aborted")
                outputs = []
                for i in range(n):
                    if done[i]:
                        continue
                    if aborted:
                        done[i] = True
                        outputs.append(
                            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                        )
                        continue
                    if self.script is not None:
                        char = self.script[counts[i]]
                        token_id = self.tokenizer.encode(char, add_special_tokens=False)[0]
                    else:
                        char = LETTERS[(i + counts[i]) % len(LETTERS)]
                        token_id = self.tokenizer.convert_tokens_to_ids(char)
                    counts[i] += 1
                    new_text = char
                    finish: str | None = None
                    stop_reason: str | int | None = None
                    full = texts[i] + char
                    for stop in params.stop:
                        if stop in full:
                            cut = full.index(stop)
                            if params.include_stop_str_in_output:
                                cut += len(stop)
                            new_text = full[len(texts[i]) : cut] if cut > len(texts[i]) else ""
                            finish, stop_reason = "stop", stop
                            break
                    if finish is None and self.script is not None and counts[i] == len(self.script):
                        finish = "stop"  # the script's end is its EOS
                    if finish is None and counts[i] >= (params.max_tokens or 0):
                        finish = "length"
                    texts[i] += new_text
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = [self._logprobs(token_id, params.logprobs)]
                    done[i] = finish is not None
                    outputs.append(
                        CompletionOutput(
                            index=i,
                            text=new_text,
                            token_ids=[token_id],
                            logprobs=logprobs,
                            finish_reason=finish,
                            stop_reason=stop_reason,
                        )
                    )
                finished = all(done)
                prompt_logprobs = None
                if step == 1 and params.prompt_logprobs is not None:
                    # the first prompt token has no logprob; then each token at rank 1
                    prompt_logprobs = [None] + [
                        {t: Logprob(logprob=-1.0, rank=1, decoded_token=None)}
                        for t in prompt_ids[1:]
                    ]
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_ids,
                    outputs=outputs,
                    finished=finished,
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=0,
                    # the fake engine schedules a request 1 ms after it arrives
                    metrics=RequestMetrics(
                        arrival_time=arrival, first_scheduled_time=arrival + 1e-3
                    ),
                )
            finished_cleanly = True
            self.finished.append(request_id)
        finally:
            self.running.discard(request_id)
            if not finished_cleanly and self._dead is None:
                self.aborted.append(request_id)
