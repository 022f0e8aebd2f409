"""chassis's own structured-output backend: constraints as byte DFAs, masks with numpy.

Every constraint becomes an IR tree (:mod:`.regex`, :mod:`.json_schema`, :mod:`.grammar`,
:mod:`.grammar_structural_tag`, or an alternation of literal choices), then an
:class:`~.automaton.Automaton` whose states the matcher follows;
:class:`~.token_masks.TokenMasks` turns a state into the allowed-token mask. No dependency
beyond numpy, and no tokenizer-specific code (the vocabulary is bytes).

Each matcher carries a :class:`~.automaton.WorkMeter`: the DFA states its masks and tokens
make the automaton build are charged to it, so one request's constraint cannot hold the
engine core beyond :data:`DEFAULT_WORK_BUDGET` NFA states touched (or
``CHASSIS_STRUCTURED_OUTPUT_WORK_BUDGET``); past it, :meth:`ChassisGrammarMatcher.allowed_tokens`
and :meth:`~ChassisGrammarMatcher.accept_token` raise
:class:`~.automaton.WorkBudgetExceeded`.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict

import numpy as np

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import DEAD, Automaton, WorkMeter
from chassis.builtin_plugins.structured_output.regex import regex_to_ir
from chassis.builtin_plugins.structured_output.token_masks import TokenMasks, TokenTable
from chassis.core.structured_output import (
    Grammar,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputsParams,
    TokenVocabulary,
)

__all__ = [
    "DEFAULT_WORK_BUDGET",
    "ChassisGrammar",
    "ChassisGrammarMatcher",
    "ChassisStructuredOutputBackend",
    "constraint_automaton",
    "constraint_to_ir",
    "work_budget_from_env",
]

#: the default work budget of one request's constraint, in NFA states touched while building
#: DFA states (:class:`~.automaton.WorkMeter`): over 10 times what the costliest constraint
#: measured needs (a choice among 20,000 strings), and a few seconds of the engine core's
#: time for the most tangled grammars (``python tests/perf/structured_output_budget.py``;
#: docs/structured_outputs.md)
DEFAULT_WORK_BUDGET = 5_000_000
#: the environment variable that overrides :data:`DEFAULT_WORK_BUDGET` (``0``: no budget)
WORK_BUDGET_ENV = "CHASSIS_STRUCTURED_OUTPUT_WORK_BUDGET"


def work_budget_from_env() -> int | None:
    """The work budget of each request's constraint: ``$CHASSIS_STRUCTURED_OUTPUT_WORK_BUDGET``
    if set (``0``: none, ``None``), else :data:`DEFAULT_WORK_BUDGET`. ``ValueError`` for a
    value that is not a whole number of at least 0."""
    raw = os.environ.get(WORK_BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_WORK_BUDGET
    try:
        budget = int(raw)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(
            f"{WORK_BUDGET_ENV} must be a whole number >= 0 (0: no budget), not {raw!r}"
        )
    return budget or None


#: how many constraints that passed :meth:`ChassisStructuredOutputBackend.check` are kept,
#: so a client sending the same schema again is not compiled again (the API server checks
#: every request, possibly from several threads)
CHECKED_CACHE_SIZE = 256
_checked: OrderedDict[tuple, None] = OrderedDict()
_checked_lock = threading.Lock()


def constraint_to_ir(params: StructuredOutputsParams) -> ir.Node:
    """The IR tree of ``params``' constraint (``ValueError`` for an unsupported one)."""
    try:
        return _constraint_to_ir(params)
    except RecursionError:  # a last safety net only: every front end counts its own nesting
        # and refuses past MAX_NESTING_DEPTH, well within Python's default stack
        # (core/structured_nesting.py), so this is never the deciding limit
        raise ValueError(
            f"the structured-output {params.kind} constraint is nested too deeply to compile"
        ) from None
    except OverflowError as exc:  # e.g. a bound with hundreds of digits, compared as a float
        raise ValueError(
            f"the structured-output {params.kind} constraint holds a number too large: {exc}"
        ) from None


def _constraint_to_ir(params: StructuredOutputsParams) -> ir.Node:
    kind = params.kind
    if kind == "regex":
        return regex_to_ir(params.regex)
    if kind == "choice":
        return ir.alt(*(ir.literal(choice) for choice in params.choice))
    if kind == "grammar":
        from chassis.builtin_plugins.structured_output.grammar import grammar_to_ir

        return grammar_to_ir(params.grammar)
    # imported here: the JSON compilers are only needed by JSON constraints
    from chassis.builtin_plugins.structured_output.json_syntax import whitespace
    from chassis.builtin_plugins.structured_output.json_whitespace import whitespace_node

    # (the whitespace between JSON tokens: compact, a pattern's, or the default runs)
    with whitespace(whitespace_node(params)):
        return _json_constraint_to_ir(params)


def _json_constraint_to_ir(params: StructuredOutputsParams) -> ir.Node:
    kind = params.kind
    if kind == "structural_tag":
        from chassis.builtin_plugins.structured_output.grammar_structural_tag import (
            structural_tag_to_ir,
        )

        return structural_tag_to_ir(params.structural_tag)
    from chassis.builtin_plugins.structured_output import json_schema

    if kind == "json":
        return json_schema.schema_to_ir(
            json.loads(params.json), wrapper_levels=params.json_wrapper_levels
        )
    if kind == "json_object":
        return json_schema.any_json_object()
    raise ValueError(f"unknown structured-output constraint {kind!r}")


def constraint_automaton(params: StructuredOutputsParams) -> Automaton:
    """The automaton of ``params``: ``ValueError`` for an unsupported constraint, one too
    large, or one that no output can match."""
    automaton = Automaton.from_ir(constraint_to_ir(params))  # (refuses too deep, too large)
    if automaton.matches_nothing:
        raise ValueError(f"the structured-output {params.kind} constraint matches no output")
    return automaton


class ChassisGrammarMatcher(GrammarMatcher):
    """One request's DFA state in a :class:`ChassisGrammar`, and the work its DFA states
    cost (:attr:`meter`: states other matchers built already are free)."""

    def __init__(self, grammar: ChassisGrammar, work_budget: int | None = None) -> None:
        self._grammar = grammar
        self.state = grammar.automaton.start
        self.meter = WorkMeter(work_budget)

    def allowed_tokens(self) -> np.ndarray:
        """The cached, read-only mask of the current state (shared with other matchers).
        Raises :class:`~.automaton.WorkBudgetExceeded` when building it would pass this
        matcher's work budget."""
        automaton = self._grammar.automaton
        automaton.meter = self.meter
        try:
            return self._grammar.masks.allowed(self.state)
        finally:
            automaton.meter = None

    def accept_token(self, token_id: int) -> bool:
        """As :meth:`GrammarMatcher.accept_token`; raises
        :class:`~.automaton.WorkBudgetExceeded` as :meth:`allowed_tokens`."""
        automaton = self._grammar.automaton
        automaton.meter = self.meter
        try:
            return self._accept_token(token_id)
        finally:
            automaton.meter = None

    def _accept_token(self, token_id: int) -> bool:
        automaton = self._grammar.automaton
        if token_id in self._grammar.eos_token_ids:
            return automaton.is_accepting(self.state)
        token_bytes = self._grammar.token_bytes
        if not 0 <= token_id < len(token_bytes) or not token_bytes[token_id]:
            return False
        following = automaton.walk(self.state, token_bytes[token_id])
        if following == DEAD:
            return False
        self.state = following
        return True

    def is_terminated(self) -> bool:
        """Whether the output is complete and nothing but EOS may follow."""
        return self._grammar.automaton.is_terminal(self.state)


class ChassisGrammar(Grammar):
    """An automaton and its mask cache over one vocabulary; shared by every request with
    the same constraint."""

    def __init__(
        self,
        automaton: Automaton,
        tokens: TokenTable,
        vocabulary: TokenVocabulary,
        work_budget: int | None = None,
    ):
        self.automaton = automaton
        self.masks = TokenMasks(automaton, tokens)
        self.token_bytes = vocabulary.token_bytes
        self.eos_token_ids = vocabulary.eos_token_ids
        #: each matcher's work budget (``None``: unbounded)
        self.work_budget = work_budget

    def matcher(self) -> ChassisGrammarMatcher:
        return ChassisGrammarMatcher(self, self.work_budget)


class ChassisStructuredOutputBackend(StructuredOutputBackend):
    """Compiles JSON schemas, JSON objects, regexes, choices, grammars and structural tags
    into byte DFAs; keeps the ``cache_size`` most recently used grammars (by
    ``params.cache_key()``). Each request's matcher may build DFA states worth
    ``work_budget`` NFA states touched (default: :func:`work_budget_from_env`; ``None``:
    unbounded)."""

    name = "chassis"

    def __init__(
        self,
        vocabulary: TokenVocabulary,
        *,
        cache_size: int = 64,
        work_budget: int | str | None = "env",
    ) -> None:
        super().__init__(vocabulary)
        self.work_budget = work_budget_from_env() if work_budget == "env" else work_budget
        self._tokens = TokenTable(vocabulary)
        self._cache_size = cache_size
        self._grammars: OrderedDict[tuple, ChassisGrammar] = OrderedDict()

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        """Builds the IR and the NFA (no DFA states beyond the start, no tokenizer); the
        last :data:`CHECKED_CACHE_SIZE` constraints that passed are remembered."""
        key = params.cache_key()
        with _checked_lock:
            if key in _checked:
                _checked.move_to_end(key)
                return
        constraint_automaton(params)
        with _checked_lock:
            _checked[key] = None
            if len(_checked) > CHECKED_CACHE_SIZE:
                _checked.popitem(last=False)

    def compile(self, params: StructuredOutputsParams) -> ChassisGrammar:
        key = params.cache_key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = ChassisGrammar(
            constraint_automaton(params), self._tokens, self.vocabulary, self.work_budget
        )
        self._grammars[key] = grammar
        if len(self._grammars) > self._cache_size:
            self._grammars.popitem(last=False)
        return grammar
