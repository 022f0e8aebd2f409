"""Context-free grammars (GBNF / xgrammar EBNF) compiled to the structured-output byte IR.

:func:`grammar_to_ir` parses the grammar (:mod:`.grammar_parser` says what syntax is
accepted) and expands it from its ``root`` rule into one regular expression. A regular
expression cannot nest without bound, so recursion is unrolled, as the JSON-schema compiler
unrolls ``$ref``:

- a rule may be nested inside itself at most ``depth`` times (it is on the expansion stack
  at most ``depth`` times); past that, the recursive alternative matches nothing, so an
  alternative without the recursion ends it: ``"(" expr ")"`` allows ``depth - 1`` levels
  of parentheses. A rule that is a list by recursion on itself (``list ::= item ("," list)?``,
  ``expr ::= expr "+" term | term``) is read as the loop it derives first
  (:mod:`.grammar_lists`), so it has no such bound;
- ``depth`` starts at :data:`MAX_RECURSION_DEPTH` and is lowered (to 1 at least, which
  forbids nesting a rule in itself) until the automaton fits in
  :data:`~.automaton.MAX_NFA_STATES` and the expansion nests at most
  :data:`~chassis.core.structured_nesting.MAX_NESTING_DEPTH` levels (each rule expanded
  inside another is a level, and so are groups and repetitions inside a rule, as
  :func:`~.grammar_parser.nesting_cost` counts them); a grammar too large or too deep even
  then is refused;
- loops written with ``*`` and ``+`` are not recursion and stay unbounded; a list written
  ``item ("," item)*`` (whatever its parts) is built with one copy of its item
  (:mod:`.grammar_lists`), so lists nested in lists grow the automaton linearly.

Refused with ``ValueError``: syntax errors, undefined rules and a missing ``root``
(:func:`~.grammar_parser.parse_grammar`, naming line and column); a grammar whose ``root``
can never finish (every way through it recurses forever), naming the rules at fault; and
grammars too large to enforce (an automaton over the limit, more than
:data:`MAX_EXPANSIONS` expansions, or nesting past the limit, such as rules that reference
each other in a chain longer than it). The expansion counts its nesting itself, so the
outcome never depends on Python's recursion limit.

Characters are Unicode code points: a literal is its UTF-8 bytes, ``[...]``, ``[^...]`` and
``.`` match one whole character.
"""

from __future__ import annotations

from collections.abc import Iterable

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import (
    MAX_NFA_STATES,
    estimated_nfa_states,
)
from chassis.builtin_plugins.structured_output.grammar_lark import is_lark, lark_to_gbnf
from chassis.builtin_plugins.structured_output.grammar_lists import separated_lists
from chassis.builtin_plugins.structured_output.grammar_parser import (
    ROOT,
    AnyChar,
    CharClass,
    Choice,
    Expr,
    Literal,
    Repetition,
    Rule,
    RuleRef,
    SeparatedRepetition,
    Sequence,
    children,
    nesting_cost,
    parse_grammar,
)
from chassis.builtin_plugins.structured_output.json_syntax import NOTHING, join, repeat
from chassis.core.structured_nesting import MAX_NESTING_DEPTH, nested_too_deeply

__all__ = ["MAX_RECURSION_DEPTH", "grammar_to_ir"]

#: how many times a rule may be nested in itself at most (lowered for large grammars)
MAX_RECURSION_DEPTH = 10
#: the most (rule, counts) expansions one compilation makes; beyond it the grammar is
#: treated as too large at that depth (in a group of ``n`` mutually recursive rules there
#: can be up to ``depth ** n`` different counts)
MAX_EXPANSIONS = 10_000

_ANY_CHAR = ir.unicode_char()
#: how many times each rule of a recursive group is on the expansion stack, sorted by name
_Counts = tuple[tuple[str, int], ...]


class _TooLarge(Exception):
    """This depth makes the expansion too large."""


class _TooDeep(Exception):
    """This depth makes the expansion nest deeper than :data:`MAX_NESTING_DEPTH`."""


def grammar_to_ir(text: str, *, lists: bool = True) -> ir.Node:
    """The texts the grammar ``text`` derives from its ``root`` rule, with recursion
    unrolled (see the module docstring). A Lark grammar (grammar_lark.py: no ``::=``, rules
    ``name: ...``) is translated to GBNF first, its ``start`` rule becoming ``root`` (which
    messages call ``start`` again: a Lark grammar has no rule ``root`` of its own).

    ``lists`` (the default) builds each ``item (separator item)*`` shape as a separated
    repetition, its item once (:mod:`.grammar_lists`); ``False`` compiles the rules as
    written, the reference that tests compare with."""
    lark = is_lark(text)
    start = "start" if lark else ROOT  # (the start rule, as the user named it)
    if lark:
        text = lark_to_gbnf(text)
        try:
            rules = parse_grammar(text)
        except ValueError as exc:
            message = str(exc).replace(f"rule {ROOT!r}", f"rule {start!r}")
            raise ValueError(f"the Lark grammar, translated to GBNF: {message}") from None
    else:
        rules = parse_grammar(text)
    if lists:
        rules = separated_lists(rules)
    groups = _recursive_groups(rules)
    stuck = _unproductive(rules, groups)
    if ROOT in stuck:
        reachable = [
            start if name == ROOT else name
            for name in _reachable(_edges(rules), ROOT)
            if name in stuck
        ]
        raise ValueError(
            f"the grammar matches no text: every way through rule {start!r} recurses forever "
            f"(rules that can never finish: {', '.join(reachable)}); give each recursion an "
            "alternative that does not recurse"
        )
    components = {name: group for group in groups for name in group}
    node, states, cut = _attempt(rules, components, MAX_RECURSION_DEPTH)
    if node is None or states > MAX_NFA_STATES:
        if not cut and node is not None:  # no recursion to lower: too large as it is
            raise _too_large(states, recursive=False)
        # the largest depth that fits (the size grows with the depth)
        low, high, best = 1, MAX_RECURSION_DEPTH - 1, None
        while low <= high:
            middle = (low + high) // 2
            node, states, _ = _attempt(rules, components, middle)
            if node is not None and states <= MAX_NFA_STATES:
                best, low = node, middle + 1
            else:
                high = middle - 1
        if best is None:
            raise _too_large(states, recursive=True)
        node = best
    if node == NOTHING:
        raise ValueError("the grammar matches no text (e.g. an empty character class)")
    return node


def _too_large(states: int, *, recursive: bool) -> ValueError:
    unrolled = " even with no rule nested in itself" if recursive else ""
    if states == -1:  # (whatever the unrolling: the deepest part of it is not recursion)
        return nested_too_deeply("the grammar's rules, groups and repetitions are")
    why = {
        0: f"expanding it takes more than {MAX_EXPANSIONS} rule expansions",
    }.get(states, f"its automaton would need about {states} states, more than {MAX_NFA_STATES}")
    return ValueError(
        f"the grammar is too large to enforce: {why}{unrolled}; use fewer or smaller bounded "
        "repetitions ({m,n}), fewer alternatives, or less recursion"
    )


def _attempt(
    rules: dict[str, Rule], components: dict[str, frozenset[str]], depth: int
) -> tuple[ir.Node | None, int, bool]:
    """(IR, estimated NFA states, whether the depth cut any recursion) at ``depth``; the IR
    is ``None`` when the expansion itself is too large (states 0: too many expansions, -1:
    nested deeper than :data:`MAX_NESTING_DEPTH`)."""
    compiler = _Compiler(rules, components, depth)
    try:
        node, _ = compiler.rule(ROOT, (), 0)
        return node, estimated_nfa_states(node), compiler.cut
    except _TooLarge:
        return None, 0, True
    except _TooDeep:
        return None, -1, True


class _Compiler:
    """Expands rules into IR at one recursion ``depth``.

    Rules that can reach each other form a recursive group (a strongly connected component
    of the rule graph). A rule's expansion depends only on how many times each rule of its
    group is already on the expansion stack (rules outside the group cannot lead back into
    it), so every expansion is memoized by ``(rule, those counts)`` and the IR shares the
    sub-trees.
    """

    def __init__(
        self, rules: dict[str, Rule], components: dict[str, frozenset[str]], depth: int
    ) -> None:
        self.rules = rules
        self.components = components
        self.depth = depth
        #: (IR, height) of each expansion (see :meth:`rule`)
        self.memo: dict[tuple[str, _Counts], tuple[ir.Node, int]] = {}
        self.cut = False

    def rule(self, name: str, counts: _Counts, level: int) -> tuple[ir.Node, int]:
        """Rule ``name`` when the rules of its group are on the stack ``counts`` times, its
        body at nesting ``level``: its IR and its body's height (the levels it nests
        below ``level``). :class:`_TooDeep` past :data:`MAX_NESTING_DEPTH`."""
        key = (name, counts)
        known = self.memo.get(key)
        if known is None:
            on_stack = dict(counts)
            if on_stack.get(name, 0) >= self.depth:
                self.cut = True
                return NOTHING, 0
            if len(self.memo) >= MAX_EXPANSIONS:
                raise _TooLarge
            on_stack[name] = on_stack.get(name, 0) + 1
            known = self.expr(self.rules[name].body, tuple(sorted(on_stack.items())), level, None)
            self.memo[key] = known
        if level + known[1] > MAX_NESTING_DEPTH:  # (an expansion met again, deeper)
            raise _TooDeep
        return known

    def expr(
        self, expr: Expr, counts: _Counts, level: int, parent: Expr | None
    ) -> tuple[ir.Node, int]:
        """``expr`` in a rule body (inside ``parent``, ``None`` at the top, whose nesting is
        ``level``), with the rules of that rule's group on the stack ``counts`` times: its
        IR and its height (the levels from ``level`` to its deepest part)."""
        cost = nesting_cost(parent, expr)
        level += cost
        if level > MAX_NESTING_DEPTH:
            raise _TooDeep
        if isinstance(expr, Literal):
            return ir.literal(expr.text), cost
        if isinstance(expr, CharClass):
            ranges: Iterable[tuple[int, int]] = expr.ranges
            return ir.codepoint_ranges(ir.complement(ranges) if expr.negated else ranges), cost
        if isinstance(expr, AnyChar):
            return _ANY_CHAR, cost
        if isinstance(expr, RuleRef):  # the rule's expansion is one level deeper
            group = self.components[expr.name]
            inner = tuple(item for item in counts if item[0] in group)
            node, height = self.rule(expr.name, inner, level + 1)
            return node, cost + 1 + height
        if isinstance(expr, Sequence | Choice | Repetition | SeparatedRepetition):
            parts = [self.expr(child, counts, level, expr) for child in children(expr)]
            height = cost + max((height for _, height in parts), default=0)
            nodes = [node for node, _ in parts]
            if isinstance(expr, Sequence):
                return join(*nodes), height
            if isinstance(expr, Choice):
                return _either(nodes), height
            if isinstance(expr, SeparatedRepetition):
                return _separated(expr, nodes), height
            return _repeated(nodes[0], expr.min, expr.max), height
        raise TypeError(f"not a grammar expression: {expr!r}")


def _separated(expr: SeparatedRepetition, nodes: list[ir.Node]) -> ir.Node:
    """The separated repetition ``expr`` whose children (its separator's items, then its
    item's) compiled to ``nodes``: an ``ir.Repeat`` with a separator, the item built once
    (no separator, or one that matches only the empty text: a plain repetition)."""
    count = len(expr.separator)
    separator = join(*nodes[:count]) if count else ir.EMPTY
    item = join(*nodes[count:])
    return repeat(item, expr.min, expr.max, None if separator == ir.EMPTY else separator)


def _repeated(node: ir.Node, low: int, high: int | None) -> ir.Node:
    """``node`` ``low`` to ``high`` times; an optional list (``(item ("," item)*)?``, as
    Lark's ``[...]`` translates) is the list from zero items, not a repetition of it (the
    same texts, a few states fewer)."""
    if (
        (low, high) == (0, 1)
        and isinstance(node, ir.Repeat)
        and node.separator is not None
        and node.min <= 1
    ):
        return ir.Repeat(node.item, 0, node.max, node.separator)
    return repeat(node, low, high)


def _either(options: list[ir.Node]) -> ir.Node:
    """:func:`~.json_syntax.either` (flattened, without options that match nothing or
    repeat), with duplicates found by identity, and by value only for leaves. Expansions
    share their sub-trees (memoized rules), so comparing two of them structurally, as
    ``ir.alt`` does, takes time exponential in their nesting: seconds for a few recursive
    rules."""
    kept: list[ir.Node] = []
    seen: set[object] = set()
    for option in options:
        for node in option.options if isinstance(option, ir.Alt) else (option,):
            key = node if isinstance(node, ir.Bytes | ir.ByteSet) else id(node)
            if node == NOTHING or key in seen:
                continue
            seen.add(key)
            kept.append(node)
    if not kept:
        return NOTHING
    return kept[0] if len(kept) == 1 else ir.Alt(tuple(kept))


# -- rule graph ----------------------------------------------------------------------------


def _referenced(expr: Expr) -> list[str]:
    if isinstance(expr, RuleRef):
        return [expr.name]
    return [name for child in children(expr) for name in _referenced(child)]


def _reachable(edges: dict[str, set[str]], start: str) -> list[str]:
    """The rules reachable from ``start`` (itself included), in discovery order."""
    seen = {start: None}
    stack = [start]
    while stack:
        for name in edges[stack.pop()]:
            if name not in seen:
                seen[name] = None
                stack.append(name)
    return list(seen)


def _edges(rules: dict[str, Rule]) -> dict[str, set[str]]:
    """The rules each rule references."""
    return {name: set(_referenced(rule.body)) for name, rule in rules.items()}


def _recursive_groups(rules: dict[str, Rule]) -> list[frozenset[str]]:
    """The strongly connected components of the rule graph (each rule with the rules it
    reaches that reach it back), every group after the groups it references.

    Tarjan's algorithm, iterative (a chain of thousands of rules is deeper than Python's
    stack) and linear in the rules and references: a grammar is request input, so nothing
    here may be quadratic in its size.
    """
    edges = _edges(rules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []
    for root in rules:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(edges[root]))]
        while work:
            name, targets = work[-1]
            for target in targets:
                if target not in index:  # descend; this rule's loop resumes after it
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                    break
                if target in on_stack:
                    low[name] = min(low[name], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[name])
                if low[name] == index[name]:  # the root of its group: pop the group
                    members = []
                    while not members or members[-1] != name:
                        members.append(stack.pop())
                        on_stack.discard(members[-1])
                    groups.append(frozenset(members))
    return groups


def _unproductive(rules: dict[str, Rule], groups: list[frozenset[str]]) -> set[str]:
    """The rules that derive no finite text (every alternative recurses forever), given the
    rules' :func:`_recursive_groups`. A group's rules depend only on its own and earlier
    groups, so each rule is checked once, plus once more whenever a rule of its group that
    it references turns out to finish."""
    productive: set[str] = set()

    def finishes(expr: Expr) -> bool:
        if isinstance(expr, RuleRef):
            return expr.name in productive
        if isinstance(expr, Sequence):
            return all(finishes(item) for item in expr.items)
        if isinstance(expr, Choice):
            return any(finishes(option) for option in expr.options)
        if isinstance(expr, Repetition):
            return expr.min == 0 or finishes(expr.item)
        if isinstance(expr, SeparatedRepetition):  # (a separator only between two items)
            needed = (*expr.item, *(expr.separator if expr.min > 1 else ()))
            return expr.min == 0 or all(finishes(item) for item in needed)
        return True

    referrers: dict[str, set[str]] = {}
    for name, targets in _edges(rules).items():
        for target in targets:
            referrers.setdefault(target, set()).add(name)
    for group in groups:
        queue = list(group)
        while queue:
            name = queue.pop()
            if name in productive or not finishes(rules[name].body):
                continue
            productive.add(name)
            queue.extend(r for r in referrers.get(name, ()) if r in group and r not in productive)
    return set(rules) - productive
