"""``SamplingParams``: how one request's tokens are chosen, validated on construction."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import msgspec

from chassis.core.structured_output import StructuredOutputsParams

#: Largest ``logprobs`` / ``prompt_logprobs`` a request may ask for.
MAX_LOGPROBS = 20
#: Largest ``n``: each completion is its own engine request, created at once, so an
#: unbounded ``n`` lets one request exhaust the front-end's memory (OpenAI's own cap is 128).
MAX_N = 1024
#: Integer fields travel to the engine core as msgpack int64.
_INT64_MAX = 2**63 - 1
#: fields that take a number (any real) and those that take an integer (or None)
_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INT_FIELDS = (
    "n",
    "top_k",
    "min_tokens",
    "max_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def is_integer(value: object) -> bool:
    """An integer as a token id or count: Python's or numpy's, but not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling settings, vLLM-compatible names and meanings.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. Invalid values
    raise ``ValueError`` with a message naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    #: constrain the output to a JSON schema, any JSON object, a regex, a list of choices, a
    #: grammar or a structural tag (vLLM's ``StructuredOutputsParams``; a ``dict`` of its
    #: fields is accepted too)
    structured_outputs: StructuredOutputsParams | None = None
    #: keep only the prompt's last ``k`` tokens (left truncation, as vLLM does); ``-1``: the
    #: last ``max_model_len`` (vLLM's meaning); above ``max_model_len`` the input processor
    #: refuses it (``ValueError``), as vLLM does
    truncate_prompt_tokens: int | None = None
    #: only these token ids may be sampled (vLLM's field); ``None``: any
    allowed_token_ids: list[int] | None = None
    #: words never generated (vLLM's field): the input processor tokenizes each, alone and
    #: after a space, into :attr:`bad_words_token_ids`; a word's last token is blocked
    #: whenever the output ends with the tokens before it
    bad_words: list[str] | None = None
    #: the token sequences of :attr:`bad_words` (set by the input processor; the engine core
    #: reads only this)
    bad_words_token_ids: list[list[int]] | None = None
    #: arguments for custom logits processors and other plugins (vLLM's field; the API's
    #: ``vllm_xargs``): a dict with string keys of JSON-like values, read by the processors
    #: that ``--logits-processors`` selects, each of which validates its own keys
    extra_args: dict[str, Any] | None = None
    #: False: this request gets no speculative drafts (set by the input processor when a
    #: logits processor that cannot verify drafts acts on it)
    allow_drafts: bool = True

    def __post_init__(self) -> None:
        # vLLM declares these Optional: None means none
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown field name
                raise ValueError(f"invalid sampling parameter structured_outputs: {exc}") from None
        self._validate()

    def _check_types(self) -> None:
        """``ValueError`` (not a ``TypeError`` from a comparison) for a value of the wrong
        type, e.g. ``temperature="0.5"``; bools are not numbers here. numpy scalars become
        Python numbers (the engine core receives these fields as msgpack)."""

        def wrong(name: str, what: str) -> ValueError:
            value = getattr(self, name)
            return ValueError(f"invalid sampling parameter {name}: must be {what}, got {value!r}")

        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise wrong(name, "a number")
            setattr(self, name, float(value))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                if not is_integer(value):
                    raise wrong(name, "an integer")
                setattr(self, name, int(value))
        if not isinstance(self.stop, list) or not all(isinstance(x, str) for x in self.stop):
            raise wrong("stop", "a string or a list of strings")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(is_integer(t) for t in ids):
            raise wrong("stop_token_ids", "a list of integers")
        self.stop_token_ids = [int(t) for t in ids]
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not all(is_integer(t) for t in allowed):
                raise wrong("allowed_token_ids", "a list of integers")
            self.allowed_token_ids = [int(t) for t in allowed]
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) for w in words)
        ):
            raise wrong("bad_words", "a list of strings")
        extra = self.extra_args
        if extra is not None:
            if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
                raise wrong("extra_args", "a dict with string keys")
            try:
                # they travel to the engine core (and tensor-parallel workers) as msgpack:
                # an integer beyond 64 bits or a non-JSON object would fail there, not here
                msgspec.msgpack.encode(extra)
            except (TypeError, ValueError, OverflowError) as exc:
                raise wrong(
                    "extra_args", f"JSON-like values with integers within 64 bits ({exc})"
                ) from None
        if not isinstance(self.allow_drafts, bool):
            raise wrong("allow_drafts", "a bool")
        sequences = self.bad_words_token_ids
        if sequences is not None and (
            not isinstance(sequences, list)
            or not all(isinstance(s, list) and all(is_integer(t) for t in s) for s in sequences)
        ):
            raise wrong("bad_words_token_ids", "a list of lists of integers")

    def _validate(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {field}: {why}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        # `not x >= 0` (rather than `x < 0`) also refuses NaN
        if not 0 <= self.temperature < math.inf:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= _INT64_MAX:
            raise bad("top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise bad(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= _INT64_MAX:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= _INT64_MAX:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or 1 <= self.truncate_prompt_tokens <= _INT64_MAX
        ):
            raise bad(
                "truncate_prompt_tokens",
                f"must be -1 (fit the context) or >= 1, got {self.truncate_prompt_tokens}",
            )
        for field, value in (
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(field, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (omit it to allow any token)")
            if any(not 0 <= t <= _INT64_MAX for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "token ids must be >= 0")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise bad("bad_words", "words must be non-empty")
        if self.bad_words_token_ids is not None and any(
            not s or any(not 0 <= t <= _INT64_MAX for t in s) for s in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "each must be a non-empty list of token ids >= 0")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(not 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        if self.logit_bias is not None and not all(
            math.isfinite(v) for v in self.logit_bias.values()
        ):
            raise bad("logit_bias", "bias values must be finite numbers")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", f"out of range: {self.seed}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict")
            if self.min_tokens:
                raise bad(
                    "min_tokens",
                    "cannot be combined with structured_outputs: the constraint decides "
                    "where the output may end",
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with ``changes`` applied (and validated)."""
        return msgspec.structs.replace(self, **changes)
