"""The engine core's side of structured outputs: one matcher per constrained request.

Before a plan runs, :meth:`StructuredOutputManager.masks_for` gives the allowed tokens of
every constrained request in it (packed bits, so they cross to tensor-parallel ranks as
bytes); the model runner masks those rows' logits before the sampler. After the plan,
:meth:`StructuredOutputManager.update` moves each matcher past the tokens sampled.

With ``reasoning_parser`` set and its tags single tokens, each request also has a
:class:`~chassis.core.reasoning_gate.ReasoningGate`: its reasoning is not constrained, only
the answer after it.

The backend is built on the first constrained request (loading the tokenizer then, so an
engine that never sees one pays nothing).

A matcher that raises while computing a mask or advancing (``ConstraintBudgetExceeded``
when a constraint needs more work than the backend's budget, or any bug) fails
only its own request: the manager forgets it and reports it in :meth:`take_failures`, and
the engine core finishes it with reason ``abort`` and that error.

A constraint whose matcher exceeded its budget computing its request's first mask (before
any constrained token) is remembered (by ``StructuredOutputsParams.cache_key()``, as the
built-in backend caches compiled grammars; the :data:`OVER_BUDGET_MEMORY_SIZE` most recently
used): later requests with the same constraint are refused at once by
:meth:`StructuredOutputManager.matcher_for`, with the same error, instead of each spending
the budget again. Only that failure is remembered: it does not depend on what was sampled,
and the budget counts deterministic units. A budget failure later in generation depends on
the sampled path, and another exception may be transient (a bug, memory); neither is
remembered.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chassis.core.reasoning_gate import Phase, ReasoningGate, ReasoningTags
from chassis.core.request import RequestError, engine_fault
from chassis.core.structured_output import (
    ConstraintBudgetExceeded,
    GrammarMatcher,
    StructuredOutputBackend,
)

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.request import EngineCoreOutput, Request
    from chassis.core.scheduler_interface import SchedulerOutput

logger = logging.getLogger(__name__)

#: how many over-budget constraints are remembered (least recently used first out): as many
#: as the built-in backend keeps compiled grammars
OVER_BUDGET_MEMORY_SIZE = 64


class StructuredOutputsUnavailable(ValueError):
    """:meth:`StructuredOutputManager.matcher_for`'s error when the engine, not the request,
    is at fault: the backend cannot be built (no tokenizer, a bad
    ``CHASSIS_STRUCTURED_OUTPUT_WORK_BUDGET``, ...) or its ``compile`` raised something other
    than ``ValueError`` (a bug). The engine core reports it as the engine's fault (HTTP 500);
    a plain ``ValueError`` from ``compile`` is the constraint's (HTTP 400)."""


def pack_mask(allowed: np.ndarray) -> bytes:
    """A ``bool [vocab]`` mask as bytes, 8 tokens per byte (``np.packbits`` order)."""
    return np.packbits(allowed).tobytes()


def unpack_masks(packed: list[bytes], vocab_size: int) -> np.ndarray:
    """``bool [len(packed), vocab_size]`` from :func:`pack_mask` outputs."""
    rows = np.frombuffer(b"".join(packed), dtype=np.uint8).reshape(len(packed), -1)
    return np.unpackbits(rows, axis=1, count=vocab_size).astype(bool)


@dataclass
class _Constrained:
    """One constrained request: its grammar's matcher and where its reasoning stands."""

    matcher: GrammarMatcher
    gate: ReasoningGate
    #: the constraint's ``cache_key()`` (``None``: not known, never remembered)
    constraint_key: Hashable | None = None
    #: tokens the matcher accepted (0: a failure cannot depend on the sampled output)
    num_accepted: int = 0


class StructuredOutputManager:
    """Matchers of the engine core's constrained requests (engine-core thread only)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._backend: StructuredOutputBackend | None = None
        #: why the backend could not be built (then every constrained request is refused)
        self._backend_error: str | None = None
        #: the exception behind ``_backend_error`` (its type is what clients are told)
        self._backend_cause: Exception | None = None
        #: the reasoning format's tags (``config.reasoning_parser``), set with the backend
        self._reasoning_tags: ReasoningTags | None = None
        self._packed_reasoning_mask: bytes | None = None
        self._requests: dict[str, _Constrained] = {}
        #: requests whose matcher raised, not reported yet (see :meth:`take_failures`)
        self._failures: dict[str, RequestError] = {}
        #: constraint key -> the error of a constraint over its budget before its first token
        #: (see the module docstring), least recently used first
        self._over_budget: OrderedDict[Hashable, str] = OrderedDict()

    @property
    def backend(self) -> StructuredOutputBackend:
        """The configured backend, built with the tokenizer's vocabulary on first use (a
        one-time cost on the engine core's thread: loading the tokenizer and mapping its
        vocabulary). A failure is kept and raised again, as
        :class:`StructuredOutputsUnavailable`, for every later request."""
        if self._backend_error is not None:
            raise StructuredOutputsUnavailable(self._backend_error) from self._backend_cause
        if self._backend is None:
            try:
                self._backend = self._build_backend()
            except Exception as exc:
                logger.exception("structured output: building the backend failed")
                self._backend_error = f"structured outputs are unavailable: {exc}"
                self._backend_cause = exc
                raise StructuredOutputsUnavailable(self._backend_error) from exc
        return self._backend

    def _build_backend(self) -> StructuredOutputBackend:
        from chassis.core.model_loader import engine_hf_config
        from chassis.core.token_vocabulary import vocabulary_from_tokenizer
        from chassis.core.tokenizer import engine_tokenizer, eos_token_ids
        from chassis.plugins import get_registries

        if self.config.skip_tokenizer_init:
            raise ValueError("structured outputs need the tokenizer (--skip-tokenizer-init)")
        assert self.config.tokenizer is not None and self.config.model is not None
        tokenizer = engine_tokenizer(self.config)  # as the front-end loads it
        # Every mask covers the model's logits, which may be wider than the tokenizer.
        vocab_size = int(engine_hf_config(self.config).vocab_size)
        vocabulary = vocabulary_from_tokenizer(
            tokenizer, vocab_size, eos_token_ids(tokenizer, self.config.model)
        )
        registries = get_registries()
        if self.config.reasoning_parser is not None:
            parser_cls = registries.reasoning_parsers.get(self.config.reasoning_parser)
            self._reasoning_tags = parser_cls.reasoning_tags(tokenizer)
        cls = registries.structured_output_backends.get(self.config.structured_output_backend)
        return cls(vocabulary)

    def matcher_for(self, request: Request) -> GrammarMatcher | None:
        """A new matcher for ``request`` if it asks for structured output (else ``None``).

        Raises ``ValueError`` when its constraint cannot be compiled (the front-end checks
        constraints before they reach the engine, so that is a backend disagreeing with its
        own ``check``), :class:`ConstraintBudgetExceeded` (a ``ValueError``: the client's
        fault) with the remembered error when the same constraint exceeded its budget before
        (see the module docstring; nothing is compiled or built then), and
        :class:`StructuredOutputsUnavailable` (a ``ValueError`` too) when the backend cannot
        be built or ``compile`` fails with another exception.
        """
        params = request.sampling_params.structured_outputs
        if params is None:
            return None
        key = params.cache_key()
        known = self._over_budget.get(key)
        if known is not None:
            self._over_budget.move_to_end(key)
            raise ConstraintBudgetExceeded(known)
        backend = self.backend
        try:
            return backend.compile(params).matcher()
        except ValueError:
            raise
        except Exception as exc:  # a backend bug: refuse this request, keep serving
            logger.exception(
                "structured output: compiling request %s's constraint failed", request.request_id
            )
            raise StructuredOutputsUnavailable(
                f"structured output: compiling the constraint failed: {type(exc).__name__}: {exc}"
            ) from exc

    def track(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        matcher: GrammarMatcher,
        after_reasoning: bool = False,
        constraint_key: Hashable | None = None,
    ) -> None:
        """Follow ``matcher`` for a request the scheduler has accepted. With
        ``after_reasoning`` (and the engine's reasoning format known by its tags) the
        request's reasoning is left free; its prompt tells whether the output starts in it.
        ``constraint_key`` (the constraint's ``cache_key()``) lets a budget failure before
        the first token be remembered (see the module docstring)."""
        tags = self._reasoning_tags if after_reasoning else None
        gate = ReasoningGate(tags, prompt_token_ids)
        self._requests[request_id] = _Constrained(matcher, gate, constraint_key)

    def has_constrained(self, plan: SchedulerOutput) -> bool:
        """Whether a request of ``plan`` is constrained."""
        return bool(self._requests) and any(r in self._requests for r in plan.num_scheduled_tokens)

    def masks_for(self, plan: SchedulerOutput) -> dict[str, bytes]:
        """Request id -> packed allowed-token mask, for every constrained request in ``plan``
        outside its reasoning (the runner applies a mask only to a row that samples this
        step). Before the first token of a format that may open with a reasoning tag, that
        tag is allowed too. A request whose matcher raises gets no mask and is failed
        (:meth:`take_failures`): the engine core must take it out of the plan."""
        masks = {}
        for request_id in plan.num_scheduled_tokens:
            constrained = self._requests.get(request_id)
            if constrained is None:
                continue
            if constrained.gate.phase is Phase.REASONING:
                masks[request_id] = self._reasoning_mask()
                continue
            try:
                allowed = constrained.matcher.allowed_tokens()
            except Exception as exc:
                # the first mask (no token accepted yet) does not depend on what was sampled
                first = constrained.num_accepted == 0
                self._fail(request_id, exc, "computing its allowed tokens", first_mask=first)
                continue
            start = constrained.gate.start_token_id
            if start is not None and start < allowed.shape[0]:
                allowed = allowed.copy()  # the matcher's array is shared: never modify it
                allowed[start] = True
            if not allowed.any():
                allowed = self._dead_end(request_id)
                if allowed is None:
                    continue
            masks[request_id] = pack_mask(allowed)
        return masks

    def _reasoning_mask(self) -> bytes:
        """Inside the reasoning every token but EOS: a constrained request must reach its
        answer (only ``max_tokens`` may cut it short)."""
        if self._packed_reasoning_mask is None:
            vocabulary = self.backend.vocabulary
            allowed = np.ones(vocabulary.vocab_size, dtype=bool)
            allowed[sorted(vocabulary.eos_token_ids)] = False
            self._packed_reasoning_mask = pack_mask(allowed)
        return self._packed_reasoning_mask

    def _dead_end(self, request_id: str) -> np.ndarray | None:
        """The mask of a request whose grammar allows no token (the vocabulary cannot spell
        what must come next, or EOS is needed and the model has none): only EOS, which ends
        it, or, without EOS ids, no constraint any more. Logged as an error: every logit at
        ``-inf`` would sample an arbitrary token."""
        eos = sorted(self.backend.vocabulary.eos_token_ids)
        logger.error(
            "structured output: request %s can write no token its grammar allows; %s",
            request_id,
            "it ends with EOS" if eos else "its output is not constrained any more",
        )
        if not eos:
            del self._requests[request_id]
            return None
        allowed = np.zeros(self.backend.vocabulary.vocab_size, dtype=bool)
        allowed[eos] = True
        return allowed

    def update(self, outputs: Iterable[EngineCoreOutput]) -> None:
        """Move matchers past the tokens the step sampled (those of the answer, not of the
        reasoning); forget finished requests."""
        if not self._requests:
            return
        for output in outputs:
            constrained = self._requests.get(output.request_id)
            if constrained is None:
                continue
            try:
                self._follow(output, constrained)
            except Exception as exc:
                self._fail(output.request_id, exc, "following its tokens")
                continue
            if output.finished:
                self._requests.pop(output.request_id, None)

    def _follow(self, output: EngineCoreOutput, constrained: _Constrained) -> None:
        """Move one request's matcher past its new tokens (forgetting the request if its
        grammar refuses one)."""
        for token_id in output.new_token_ids:
            if not constrained.gate.follow(token_id):
                continue  # reasoning, or a tag
            if constrained.matcher.accept_token(token_id):
                constrained.num_accepted += 1
            else:
                # Only a token the mask allowed can be sampled; if one is refused the
                # grammar and its masks disagree. Keep serving; say so once per request.
                logger.error(
                    "structured output: request %s sampled token %d, which its grammar "
                    "does not accept; the rest of its output is not constrained",
                    output.request_id,
                    token_id,
                )
                del self._requests[output.request_id]
                return

    def _fail(
        self, request_id: str, exc: Exception, doing: str, *, first_mask: bool = False
    ) -> None:
        """Forget ``request_id``, whose matcher raised ``exc`` while ``doing``; keep the
        error for :meth:`take_failures`. Exceeding the work budget is the request's fault
        (its constraint), and remembered when it happened computing the ``first_mask``;
        anything else is the backend's, logged with its traceback."""
        constrained = self._requests.pop(request_id, None)
        if isinstance(exc, ConstraintBudgetExceeded):
            logger.error("structured output: request %s failed: %s", request_id, exc)
            message = f"structured output: {exc}"
            error = RequestError(message=message, client_error=True)
            key = constrained.constraint_key if constrained is not None else None
            if first_mask and key is not None:
                self._remember_over_budget(key, message)
        else:
            logger.exception("structured output: request %s failed %s", request_id, doing)
            error = engine_fault(f"structured output: {doing} failed", exc)
        self._failures[request_id] = error

    def _remember_over_budget(self, key: Hashable, message: str) -> None:
        self._over_budget[key] = message
        self._over_budget.move_to_end(key)
        while len(self._over_budget) > OVER_BUDGET_MEMORY_SIZE:
            self._over_budget.popitem(last=False)

    def is_over_budget(self, key: Hashable) -> bool:
        """Whether the constraint of ``cache_key()`` ``key`` is remembered as over budget
        (without making it the most recently used)."""
        return key in self._over_budget

    def take_failures(self) -> dict[str, RequestError]:
        """Requests whose matcher raised since the last call (request id -> error); each is
        reported once and no longer tracked."""
        failures, self._failures = self._failures, {}
        return failures

    def finish(self, request_ids: Iterable[str]) -> None:
        """Forget aborted requests."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
            self._failures.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        """Constrained requests followed now (finished and aborted ones are forgotten)."""
        return len(self._requests)

    def matcher_of(self, request_id: str) -> GrammarMatcher | None:
        """The matcher of a tracked request."""
        constrained = self._requests.get(request_id)
        return None if constrained is None else constrained.matcher
