"""Pydantic models of the OpenAI request and response bodies the server speaks.

Requests accept OpenAI's fields plus vLLM's extra sampling fields (what the ``openai`` client
sends through ``extra_body``). ``None`` for an optional field means "the default", because
clients send explicit ``null``s. Unknown fields are ignored with a warning in the log, as
vLLM does. Turning a request into :class:`~chassis.core.sampling_params.SamplingParams` lives
here too (``to_sampling_params``), so every route applies the same defaults and limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from chassis.core.input_processor import logprobs_over_limit, truncation_length
from chassis.core.sampling_params import MAX_LOGPROBS, SamplingParams
from chassis.core.structured_output import StructuredOutputsParams
from chassis.serve import structured_request
from chassis.serve.errors import APIError, bad_request, from_value_error
from chassis.serve.lone_surrogates import refuse_lone_surrogates

logger = logging.getLogger(__name__)

#: OpenAI's range for ``logit_bias`` values.
LOGIT_BIAS_LIMIT = 100.0
#: The lowest logprob a response carries (vLLM's): tokens a structured-output constraint
#: forbids have -inf, which JSON cannot hold.
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """``value`` as a response carries it: at least :data:`MIN_LOGPROB`."""
    return max(value, MIN_LOGPROB)


#: ``max_tokens`` of ``/v1/completions`` when not given (or ``null``), as OpenAI's.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most choices (prompts x ``n``) one request may ask for: each is an engine request created
#: at once, so the batch is bounded, not only each prompt's ``n``.
MAX_CHOICES_PER_REQUEST = 4096


class _Request(BaseModel):
    """Base of request bodies: unknown fields are kept aside and logged, not rejected."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        """A 400 naming the field whose text holds a lone surrogate (``"\\ud800"`` in the
        JSON): no tokenizer can encode it (serve/lone_surrogates.py)."""
        return refuse_lone_surrogates(data)

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> _Request:
        if self.model_extra:
            logger.warning(
                "ignoring unknown fields in %s: %s",
                type(self).__name__,
                ", ".join(sorted(self.model_extra)),
            )
        return self


#: OpenAI's ``reasoning_effort`` values
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    #: vLLM extension: usage on every chunk, not only the last
    continuous_usage_stats: bool | None = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # -- vLLM extra_body sampling fields ----------------------------------------------------
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    #: only these token ids may be sampled
    allowed_token_ids: list[int] | None = None
    #: words the output never contains (each tokenized alone and after a space)
    bad_words: list[str] | None = None
    #: the response also carries the prompt's token ids and each choice's generated ids
    #: (vLLM's field; streamed: the prompt's in the first chunk, the new ids in every one)
    return_token_ids: bool | None = None
    #: logprob entries name their token ``"token_id:ID"`` (vLLM's field; None: the
    #: server's ``--return-tokens-as-token-ids``)
    return_tokens_as_token_ids: bool | None = None
    #: keep the prompt's last k tokens (-1: the last max_model_len, as vLLM; above
    #: max_model_len: a 400, as vLLM)
    truncate_prompt_tokens: int | None = None
    #: scheduling priority for the ``priority`` scheduler (lower runs first); a 64-bit integer
    priority: int | None = Field(0, ge=-(2**63), le=2**63 - 1)
    #: vLLM's prefix-cache isolation: cached prompt blocks are shared only between requests
    #: of the same salt (a non-empty string)
    cache_salt: str | None = Field(None, min_length=1)
    #: vLLM's custom arguments: ``SamplingParams.extra_args``, read by the engine's custom
    #: logits processors (``--logits-processors``), which validate them (a 400 otherwise)
    vllm_xargs: dict[str, Any] | None = None
    #: vLLM's beam search (serve/beam_search.py): ``n`` beams, best first, never streamed
    use_beam_search: bool | None = False
    #: beam search ranks beams by ``cum_logprob / length ** length_penalty``
    length_penalty: float | None = 1.0
    # -- structured outputs (serve/structured_request.py): at most one of them --------------
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _structured_outputs(self, forced_tool_call: bool = False) -> StructuredOutputsParams | None:
        return structured_request.from_request_fields(
            self.response_format,
            self.structured_outputs,
            {
                "guided_json": self.guided_json,
                "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar,
            },
            forced_tool_call=forced_tool_call,
        )

    def _logit_bias_ids(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids (integers as strings); got {key!r}",
                    "logit_bias",
                ) from None
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise bad_request(
                    f"logit_bias values must be in [-100, 100]; got {value} for token {key}",
                    "logit_bias",
                )
            out[token_id] = float(value)
        return out

    def _sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
        max_model_len: int | None = None,
    ) -> SamplingParams:
        """Build and validate :class:`SamplingParams`; invalid values raise a 400 ``APIError``.
        ``prompt_logprobs`` replaces the request's own field when given; ``defaults`` (the
        model's recommended sampling values) fill the fields the request leaves unset;
        ``max_model_len`` (the served model's, when known) bounds ``truncate_prompt_tokens``."""
        values: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            "logit_bias": self._logit_bias_ids(),
            "skip_special_tokens": self.skip_special_tokens,
            "structured_outputs": structured_outputs,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "extra_args": self.vllm_xargs,
        }
        # None means "not given": SamplingParams' own defaults apply.
        kwargs = {k: v for k, v in values.items() if v is not None}
        for key, value in (defaults or {}).items():
            kwargs.setdefault(key, value)
        kwargs["max_tokens"] = max_tokens
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except TypeError as exc:  # msgspec type checks
            raise bad_request(str(exc)) from None
        if max_model_len is not None:
            # vLLM's rule, checked here too so the 400 names the field (the engine's input
            # processor applies the same rule: core/input_processor.py)
            try:
                truncation_length(params.truncate_prompt_tokens, max_model_len)
            except ValueError as exc:
                raise bad_request(str(exc), "truncate_prompt_tokens") from None
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def force_include_usage(self) -> None:
        """``--enable-force-include-usage``: a stream ends with its usage chunk even when the
        request did not ask for it (vLLM's rule; usage on every chunk stays the request's
        choice, ``continuous_usage_stats``). Non-streamed answers always carry usage."""
        if not self.stream:
            return
        if self.stream_options is None:
            self.stream_options = StreamOptions(include_usage=True)
        else:
            self.stream_options.include_usage = True

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's ``continuous_usage_stats``, which (as in vLLM) only
        applies together with ``include_usage``."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: text, a batch of texts, token ids, or a batch of
    token-id lists; each prompt gets ``n`` choices (``index = prompt_index * n + i``).
    ``prompt_embeds`` (vLLM's, with ``--enable-prompt-embeds``): the base64 of a
    ``torch.save``'d ``[seq_len, hidden_size]`` tensor, or a list of them; such prompts come
    first in the batch, then ``prompt``'s (which may then be left out)."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    #: ``null`` also means the default, 16 (as OpenAI does)
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    #: number of top alternatives per token (0..--max-logprobs)
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True

    def embeds_items(self) -> list[str]:
        """``prompt_embeds`` as a list of base64 payloads (empty when not sent); a 400 for an
        empty list."""
        if self.prompt_embeds is None:
            return []
        items = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else self.prompt_embeds
        if not items:
            raise bad_request("prompt_embeds must not be empty", "prompt_embeds")
        return list(items)

    def prompts(self) -> list[str | list[int]]:
        """The batch of text and token-id prompts (without :meth:`embeds_items`); raises a
        400 for an empty one, or when neither ``prompt`` nor ``prompt_embeds`` is sent."""
        prompt = self.prompt
        if prompt is None:
            if self.prompt_embeds is None:
                raise bad_request("either prompt or prompt_embeds must be given", "prompt")
            batch: list[str | list[int]] = []
        elif isinstance(prompt, str):
            batch = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            batch = [list(prompt)]  # type: ignore[arg-type]
        else:
            batch = list(prompt)  # type: ignore[arg-type]
        for p in batch:
            if len(p) == 0:
                raise bad_request("prompt must not be empty", "prompt")
        n = self.n or 1
        num_prompts = len(batch) + len(self.embeds_items())
        if num_prompts * n > MAX_CHOICES_PER_REQUEST:
            raise bad_request(
                f"{num_prompts} prompts x n={n} ask for {num_prompts * n} choices; one request may "
                f"ask for at most {MAX_CHOICES_PER_REQUEST}: split the batch over several requests",
                "prompt",
            )
        return batch

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone (and, with
        ``logprobs``, its logprobs), as a client scoring a text asks for."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(
        self, defaults: Mapping[str, Any] | None = None, *, max_model_len: int | None = None
    ) -> SamplingParams:
        """Validate the fields this server does not implement, then build the params
        (``defaults``: the sampling values a field left unset takes; ``max_model_len``: the
        served model's, which bounds ``truncate_prompt_tokens``).

        With ``echo`` and ``logprobs``, the prompt's logprobs are computed too (at least as
        many alternatives as ``logprobs``); with :attr:`echo_only` the engine still makes one
        token, which the response leaves out."""
        self._check_stream_options()
        if self.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of other than n is not supported", "best_of")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if self.echo_only and self.min_tokens:
            # the engine is asked for one token; say what the client sent, not that
            raise bad_request(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens (0)", "min_tokens"
            )
        prompt_logprobs = None
        if self.echo and self.logprobs is not None:
            asked = self.prompt_logprobs
            # a negative prompt_logprobs is passed on as sent, for SamplingParams to refuse
            negative = asked is not None and asked < 0
            prompt_logprobs = asked if negative else max(self.logprobs, asked or 0)
        return self._sampling_params(
            max_tokens=1 if self.echo_only else max_tokens,
            logprobs=self.logprobs,
            structured_outputs=self._structured_outputs(),
            prompt_logprobs=prompt_logprobs,
            defaults=defaults,
            max_model_len=max_model_len,
        )


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completion logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt logprob entry (``prompt_logprobs`` request field)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: per prompt position: ``None`` for the first token, else token id (as a string) -> entry
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def check_max_logprobs(max_logprobs: int, **fields: int | None) -> None:
    """A 400 naming the field (``param``) whose logprobs count exceeds ``--max-logprobs``;
    ``fields`` are the request's fields as the client named them. The rule is the engine's
    (:func:`~chassis.core.input_processor.logprobs_over_limit`), checked here first so the
    error names what the client sent rather than the engine's ``logprobs``."""
    for name, value in fields.items():
        message = logprobs_over_limit(name, value, max_logprobs)
        if message is not None:
            raise bad_request(message, name)


def _without_absent(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``data`` without those of ``keys`` whose value is ``None`` (fields sent only when a
    request asked for them)."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM extension: the stop string or stop token id that ended this choice
    stop_reason: int | str | None = None
    #: vLLM extension (non-streaming responses, when ``prompt_logprobs`` was asked for)
    prompt_logprobs: PromptLogprobs | None = None
    #: vLLM extension (``return_token_ids``): the prompt's ids and this choice's generated
    #: ids; left out of the JSON otherwise
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "prompt_token_ids", "token_ids")


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """One message of the conversation; extra keys (e.g. ``reasoning_content``) reach the
    chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: OpenAI's reasoning effort: the chat template's ``reasoning_effort`` variable
    #: (gpt-oss's template writes it into the system message; a template that does not
    #: read it ignores it); ``chat_template_kwargs.reasoning_effort`` wins
    reasoning_effort: ReasoningEffort | None = None
    # -- vLLM extras ------------------------------------------------------------------------
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    #: the request's own chat template (its text): a 400 unless the server runs with
    #: ``--trust-request-chat-template`` (:func:`chassis.serve.renderer.request_chat_template`)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: with ``--reasoning-parser``: false drops the reasoning from the response
    include_reasoning: bool | None = True
    #: vLLM's: when the last message has the response's role (an assistant message being
    #: continued), each choice's content starts with that message's content
    echo: bool | None = False
    #: vLLM's: the model's image processor settings for this request's images (Qwen2-VL:
    #: ``min_pixels``, ``max_pixels``)
    mm_processor_kwargs: dict[str, Any] | None = None

    def to_sampling_params(
        self, defaults: Mapping[str, Any] | None = None, *, max_model_len: int | None = None
    ) -> SamplingParams:
        """Validate the fields this server does not implement, then build the params
        (``defaults``: the sampling values a field left unset takes; ``max_model_len``: the
        served model's, which bounds ``truncate_prompt_tokens``).

        ``max_tokens`` ``None`` (neither ``max_completion_tokens`` nor ``max_tokens`` given)
        means "up to the context length", as OpenAI's chat API does.
        """
        self._check_stream_options()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        # checked here: SamplingParams would name its own field, ``logprobs``, which on this
        # route is the boolean the client sent
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                "top_logprobs",
            )
        self._check_tools()
        constraint = self._structured_outputs(forced_tool_call=self.forces_tool_calls)
        if self.forces_tool_calls:
            if constraint is not None:
                raise bad_request(
                    "tool_choice 'required' or a named function already constrains the output; "
                    "drop response_format / structured_outputs",
                    "tool_choice",
                )
            assert self.tools and self.tool_choice is not None
            constraint = structured_request.with_options(  # (e.g. compact arguments)
                structured_request.for_tool_choice(
                    self.tool_choice, self.tools, self.parallel_tool_calls is not False
                ),
                structured_request.whitespace_options(self.structured_outputs),
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs=constraint,
            defaults=defaults,
            max_model_len=max_model_len,
        )

    @property
    def forces_tool_calls(self) -> bool:
        """``tool_choice`` is ``"required"`` or names a function (and ``tools`` are given):
        the output is constrained to the calls' JSON (serve/structured_request.py)."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )

    def template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template gets besides the messages: ``chat_template_kwargs``, with
        ``reasoning_effort`` added when sent (the kwargs' own ``reasoning_effort`` wins)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def _check_tools(self) -> None:
        """400s for malformed ``tools`` and ``tool_choice`` (whether this server can honour a
        well-formed ``tool_choice`` is :class:`~chassis.serve.chat_parsing.ChatParsers`'
        call)."""
        names = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools[{i}].type must be 'function'; got {tool.get('type')!r}",
                    f"tools.{i}.type",
                )
            function = tool.get("function")
            if not isinstance(function, dict) or not _is_name(function.get("name")):
                raise bad_request(
                    f"tools[{i}].function must be an object with a non-empty string 'name'",
                    f"tools.{i}.function",
                )
            parameters = function.get("parameters")  # null: none, as when absent
            if parameters is not None and not isinstance(parameters, dict):
                raise bad_request(
                    f"tools[{i}].function.parameters must be a JSON Schema object",
                    f"tools.{i}.function.parameters",
                )
            names.append(function["name"])
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not _is_name(name):
                raise bad_request(
                    "a named tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                    "tool_choice",
                )
            if name not in names:
                raise bad_request(
                    f"tool_choice names {name!r}, which is not in tools", "tool_choice"
                )
        elif choice not in ("auto", "required"):
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a named function; got "
                f"{choice!r}",
                "tool_choice",
            )
        if not names:
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    #: the model's reasoning, split off by ``--reasoning-parser`` (vLLM's field name); left
    #: out of the JSON when there is none
    reasoning: str | None = None
    #: the same text as ``reasoning``, always (the name DeepSeek's API, LangChain, Open WebUI
    #: and older vLLM read); set from ``reasoning`` when serialized
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_absent_reasoning(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("reasoning") is None:
            data.pop("reasoning", None)
            data.pop("reasoning_content", None)
        else:
            data["reasoning_content"] = data["reasoning"]
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: vLLM extension (``return_token_ids``): the generated ids; left out otherwise
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    #: vLLM extension (when ``prompt_logprobs`` was asked for)
    prompt_logprobs: PromptLogprobs | None = None
    #: vLLM extension (``return_token_ids``): the rendered prompt's ids; left out otherwise
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "prompt_token_ids")


class DeltaMessage(BaseModel):
    """The new part of a streamed message; absent fields are omitted from the JSON."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    #: the same text as ``reasoning``, always (see :class:`ChatResponseMessage`)
    reasoning_content: str | None = None
    #: calls, whole or in pieces: a call's first item ``{"index", "id", "type": "function",
    #: "function": {"name", "arguments"}}``, then ``{"index", "function": {"arguments"}}``
    #: items carrying the next pieces of its arguments
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data["reasoning_content"] = data.get("reasoning")
        return {k: v for k, v in data.items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: ``return_token_ids``: the ids generated since the previous chunk; left out otherwise
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "token_ids")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    #: ``return_token_ids``: the prompt's ids, in the first chunk only; left out otherwise
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "prompt_token_ids")


# ---------------------------------------------------------------------------------------------
# /v1/models, /tokenize, /detokenize, /version
# ---------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "chassis"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's route): serve the adapter at ``lora_path`` as
    ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's route): stop serving ``lora_name``
    (``lora_int_id``, which vLLM accepts, is ignored)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (chat; with
    ``image_url`` parts for a model that takes images, each expanded to its image tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: default: True for ``prompt``, False for ``messages`` (the template holds BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[dict[str, Any]] | None = None
    #: as on ``/v1/chat/completions`` (a 400 without ``--trust-request-chat-template``)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    #: vLLM's: the image processor settings for the messages' images (as on the chat route)
    mm_processor_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if self.messages is not None and not self.messages:  # as the chat route says it
            raise bad_request("messages must not be empty", "messages")
        if self.messages is not None and self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (see :mod:`chassis.serve.errors`)."""

    error: ErrorInfo


__all__ = [
    "APIError",
    "ChatChoice",
    "ChatChoiceLogprobs",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobToken",
    "ChatLogprobTop",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptLogprobs",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "UsageInfo",
    "VersionResponse",
]
