"""Structured outputs: what a request asks its output to match, and the backend interface.

A request's :class:`StructuredOutputsParams` (``SamplingParams.structured_outputs``) names
one constraint: a JSON schema, any JSON object, a regular expression, one of a list of
strings, a grammar (GBNF), or a structural tag. A :class:`StructuredOutputBackend` (registered with
``chassis_register_structured_output_backends``, chosen with ``--structured-output-backend``)
compiles it into a :class:`Grammar` over the tokenizer's vocabulary; every request gets its
own :class:`GrammarMatcher`, which says before each step which tokens may come next
(:meth:`GrammarMatcher.allowed_tokens`) and follows the tokens sampled
(:meth:`GrammarMatcher.accept_token`). The engine core masks the other tokens' logits before
the sampler runs, so any sampler works with any backend.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np

from chassis.core.structured_nesting import (
    FORCED_TOOL_CALL_LEVELS,
    check_json_text_nesting,
    check_json_value_nesting,
)

__all__ = [
    "ConstraintBudgetExceeded",
    "Grammar",
    "GrammarMatcher",
    "StructuredOutputBackend",
    "StructuredOutputsParams",
    "TokenVocabulary",
]

#: the fields of :class:`StructuredOutputsParams` that name a constraint
CONSTRAINT_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: the constraints whose JSON the whitespace options shape
JSON_KINDS = ("json", "json_object", "structural_tag")
#: vLLM's options that ask for what the built-in backend does anyway: accepted, true or
#: false, on a request and in ``--structured-outputs-config``. The engine has one backend and
#: never falls back to another (``disable_fallback``), and a schema's object gets only its
#: declared properties whatever ``additionalProperties`` says
#: (``disable_additional_properties``; docs/structured_outputs.md)
NO_OP_OPTIONS = ("disable_fallback", "disable_additional_properties")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """The constraint on one request's output; exactly one field is set (vLLM's names).

    - ``json``: a JSON schema, as a ``dict`` (or ``True``/``False``) or its JSON text (kept
      as text, so property
      order, which decides the order the properties are generated in, is preserved);
    - ``json_object``: ``True`` for any JSON object (OpenAI's ``response_format``
      ``{"type": "json_object"}``);
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a GBNF grammar (llama.cpp / xgrammar EBNF) whose ``root`` rule the output
      must match;
    - ``structural_tag``: vLLM's older ``response_format`` of type ``structural_tag``
      (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``), as a ``dict``
      or its JSON text (kept as text).

    Two of vLLM's options shape a JSON constraint (``json``, ``json_object``, and the
    schemas of a ``structural_tag``); another constraint with either is a ``ValueError``:

    - ``disable_any_whitespace``: compact JSON, no whitespace between tokens (strings keep
      theirs);
    - ``whitespace_pattern``: a regex for each whitespace run between tokens, matching JSON
      whitespace only (space, tab, newline, carriage return); not with
      ``disable_any_whitespace``.

    A malformed value raises ``ValueError`` naming the field. Whether a backend supports the
    constraint (every JSON-schema keyword, every regex feature) is the backend's
    :meth:`StructuredOutputBackend.check`.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    #: constrain only the answer after the model's reasoning, with the engine's
    #: ``reasoning_parser`` (its tags must be single tokens); the chat route sets it for JSON
    #: constraints when the server has a reasoning parser (docs/structured_outputs.md)
    after_reasoning: bool = False
    #: the subschema levels of ``json`` that wrap the user's schemas (a forced tool call's
    #: array of calls, :data:`~chassis.core.structured_nesting.FORCED_TOOL_CALL_LEVELS`),
    #: which do not count against the nesting limit, so a tool's ``parameters`` may nest as
    #: deep as a schema. Set by the server for forced tool calls (an HTTP request that names
    #: it is a 400); a field because the constraint reaches the engine core as this struct.
    #: An offline caller may set it too, 0..3: 3 more levels at most, which the stack
    #: measurement at the limit covers (tests/test_structured_nesting.py)
    json_wrapper_levels: int = 0
    #: compact JSON: no whitespace between tokens
    disable_any_whitespace: bool = False
    #: a regex for the whitespace between JSON tokens (``None``: the backend's default)
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        # nesting is checked before json.dumps/json.loads, which would otherwise stop at
        # Python's recursion limit (core/structured_nesting.py)
        if isinstance(self.json, dict | bool):  # a schema object, or the schemas true/false
            check_json_value_nesting(self.json, "structured_outputs.json")
            try:  # frozen struct: set the normalized text through the base class
                msgspec.structs.force_setattr(self, "json", json.dumps(self.json))
            except (RecursionError, ValueError) as exc:
                raise ValueError(f"structured_outputs.json cannot be serialized: {exc}") from None
        if isinstance(self.structural_tag, dict):
            check_json_value_nesting(self.structural_tag, "structured_outputs.structural_tag")
            try:
                msgspec.structs.force_setattr(
                    self, "structural_tag", json.dumps(self.structural_tag)
                )
            except (RecursionError, ValueError) as exc:
                raise ValueError(
                    f"structured_outputs.structural_tag cannot be serialized: {exc}"
                ) from None
        set_fields = [
            name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)
        ]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {set_fields or 'none'}"
            )
        if self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError("structured_outputs.json must be a JSON schema (object or text)")
            check_json_text_nesting(self.json, "structured_outputs.json")
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        for flag in ("json_object", "after_reasoning", "disable_any_whitespace"):
            if getattr(self, flag) is not False and getattr(self, flag) is not True:
                raise ValueError(f"structured_outputs.{flag} must be true or false")
        for field in ("regex", "grammar", "structural_tag"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{field} must be a non-empty string")
        self._check_whitespace_options()
        if self.structural_tag is not None:
            check_json_text_nesting(self.structural_tag, "structured_outputs.structural_tag")
        if not (
            isinstance(self.json_wrapper_levels, int)
            and 0 <= self.json_wrapper_levels <= FORCED_TOOL_CALL_LEVELS
        ):
            raise ValueError(
                f"structured_outputs.json_wrapper_levels must be 0..{FORCED_TOOL_CALL_LEVELS}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )

    def _check_whitespace_options(self) -> None:
        pattern = self.whitespace_pattern
        if pattern is not None and (not isinstance(pattern, str) or not pattern):
            raise ValueError("structured_outputs.whitespace_pattern must be a non-empty string")
        if pattern is not None and self.disable_any_whitespace:
            raise ValueError(
                "structured_outputs: give disable_any_whitespace or whitespace_pattern, not both"
            )
        if (pattern is not None or self.disable_any_whitespace) and self.kind not in JSON_KINDS:
            option = "whitespace_pattern" if pattern is not None else "disable_any_whitespace"
            raise ValueError(
                f"structured_outputs.{option} applies to JSON constraints only (json, "
                f"json_object, structural_tag), not to {self.kind}"
            )

    @property
    def kind(self) -> str:
        """The field that is set: one of :data:`CONSTRAINT_FIELDS`."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple[Any, ...]:
        """Equal for equal constraints (a backend may cache compiled grammars by it)."""
        value = getattr(self, self.kind)
        key = (self.kind, tuple(value) if isinstance(value, list) else value)
        # (the same schema as a forced tool call's wrapper may nest deeper)
        if self.json_wrapper_levels:
            key = (*key, self.json_wrapper_levels)
        # (the same schema with other whitespace between tokens is another automaton)
        if self.disable_any_whitespace:
            key = (*key, "disable_any_whitespace")
        if self.whitespace_pattern is not None:
            key = (*key, "whitespace_pattern", self.whitespace_pattern)
        return key


@dataclass(frozen=True)
class TokenVocabulary:
    """The tokenizer's tokens as the byte strings they stand for.

    ``token_bytes[i]`` is what token ``i`` adds to the output text, as UTF-8 bytes (a token
    may hold part of a character); ``None`` for a special or unused id, which a grammar never
    allows. Its length is ``vocab_size``, the width of the model's logits (which may exceed
    the tokenizer's size). ``eos_token_ids`` end the output: a grammar allows them exactly
    when the output so far is complete. ``tokenizer`` is the HF tokenizer, for backends that
    read it themselves.
    """

    token_bytes: Sequence[bytes | None]
    eos_token_ids: frozenset[int]
    tokenizer: Any = None

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)


class ConstraintBudgetExceeded(ValueError):
    """Raised by a :class:`GrammarMatcher` whose constraint needs more work than the backend
    allows one request (the built-in backend's work budget). The engine core fails that
    request alone, as the client's fault (HTTP 400), with this message. Any other exception
    from a matcher fails the request too, as the engine's fault (HTTP 500)."""


class GrammarMatcher(ABC):
    """One request's position in a :class:`Grammar`. Used by the engine core only, from one
    thread. A method that raises fails only this matcher's request (see
    :class:`ConstraintBudgetExceeded`)."""

    @abstractmethod
    def allowed_tokens(self) -> np.ndarray:
        """Which tokens may come next: a ``bool`` array of ``vocab_size`` entries.

        EOS ids are allowed exactly when the output so far is a complete match. The array may
        be shared (cached per state): callers must not modify it.
        """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``. Returns ``False`` (and stays where it was) for a token
        :meth:`allowed_tokens` does not allow. After the output is complete, an EOS id is
        accepted and changes nothing."""


class Grammar(ABC):
    """A compiled constraint; shared by every request that asks for it."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the output."""


class StructuredOutputBackend(ABC):
    """Compiles constraints into grammars over one vocabulary.

    Built once per engine, in the engine-core process (and in each tensor-parallel driver),
    the first time a request asks for structured output, with the tokenizer's vocabulary.
    The API server calls the classmethod :meth:`check` to refuse unsupported constraints with
    a 400 before a request reaches the engine.
    """

    #: the name the built-in registers it under (for messages)
    name: ClassVar[str] = ""

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        self.vocabulary = vocabulary

    @classmethod
    @abstractmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` with a message for the user if this backend cannot compile
        ``params`` (an unsupported schema keyword, a malformed regex). Cheap: no tokenizer."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar of ``params`` over :attr:`vocabulary` (``ValueError`` as :meth:`check`).
        May be cached by ``params.cache_key()``."""
