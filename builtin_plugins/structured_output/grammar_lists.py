"""Separated lists in a grammar's rules, recognised so that the automaton builds their item
once.

Grammars write a list as its item, then a repetition of a separator and the item again:
``item ("," item)*`` (llama.cpp's json.gbnf: ``value ("," ws value)*``), Lark's
``[item ("," item)*]`` (translated to ``(item ("," item)*)?``), ``x x*``. Compiled as
written, the item is in the IR twice, and the automaton copies a sub-tree at each use, so
every level of lists nested in lists doubled the automaton. :func:`separated_lists`
rewrites, in each sequence of each rule, items ``X1 .. Xj`` followed by a repetition of a
group ``(S1 .. Sk X1 .. Xj)`` (``{m,n}`` times, any of ``* + ? {m,n}``) into one
:class:`~.grammar_parser.SeparatedRepetition` of the item ``X1 .. Xj`` with the separator
``S1 .. Sk`` (``k`` may be 0), ``m + 1`` to ``n + 1`` times: the same language, which the
compiler turns into an ``ir.Repeat`` with a separator. Whatever the rules are called: the
items are compared as expressions (a rule reference by its name, not where it is written),
and the longest item that matches is taken (``ws value ("," ws value)*`` lists
``ws value``).

A rule that is a list by recursion on itself, ``list ::= item ("," list)?``,
``list ::= item | item "," list`` or ``list ::= list "," item | item``, is first written
as the loop ``item ("," item)*`` it derives: recursion is unrolled to a bounded depth
(:mod:`.grammar`), so as written such a list stopped at 10 items; as a loop it has no
bound, and its item is built once.

The nesting the rewritten rule counts (:func:`~.grammar_parser.nesting_cost`) is the
written one's: the separated repetition is one level, as the repeated group was, and its
items are inside it as the group's were. What a ``(...)?`` around a list adds is folded in
the IR instead (:mod:`.grammar`), so the grammar's nesting stays as written. (A list by
recursion nests less as a loop than its unrolled recursion did.)
"""

from __future__ import annotations

from dataclasses import replace

from chassis.builtin_plugins.structured_output.grammar_parser import (
    Choice,
    Expr,
    Repetition,
    Rule,
    RuleRef,
    SeparatedRepetition,
    Sequence,
    children,
)

__all__ = ["same_expr", "separated_lists"]


def separated_lists(rules: dict[str, Rule]) -> dict[str, Rule]:
    """``rules`` with every ``item (separator item){m,n}`` shape of their sequences written
    as a :class:`~.grammar_parser.SeparatedRepetition` (see the module docstring), and
    every rule that is a list by recursion written as a loop first (:func:`_as_loop`). The
    rules derive the same texts as before, except that a list by recursion is no longer cut
    where recursion is unrolled. Linear in the grammar's size times its nesting (which the
    parser bounds)."""
    return {
        name: replace(rule, body=_rewrite(_as_loop(name, rule.body)))
        for name, rule in rules.items()
    }


def _as_loop(name: str, body: Expr) -> Expr:
    """The body of rule ``name`` written ``X (S X)*`` when it is a list by recursion on
    itself: ``X (S name)?`` or ``X | X S name`` (either order: tail recursion) or
    ``name S X | X`` (left recursion), where ``X`` and ``S`` (items, possibly none) do not
    reference ``name`` themselves (they may through other rules: those stay recursion). Each derives the same texts (a rule's
    language is the least solution of its equation, and ``X (S X)*`` is that of all
    three), and as a loop the list is not cut where recursion is unrolled. Any other body
    is returned as it is."""
    own = RuleRef(name, 0, 0)
    candidates: list[tuple[tuple[Expr, ...], tuple[Expr, ...]]] = []  # (X, S)
    if isinstance(body, Sequence) and len(body.items) >= 2:
        *first, last = body.items
        if isinstance(last, Repetition) and (last.min, last.max) == (0, 1):
            tail = _items(last.item)
            if same_expr(tail[-1], own):
                candidates.append((tuple(first), tail[:-1]))
    if isinstance(body, Choice) and len(body.options) == 2:
        for short, long in (body.options, body.options[::-1]):
            item, longer = _items(short), _items(long)
            extra = len(longer) - len(item)
            if extra < 1:
                continue
            if same_expr(longer[-1], own) and _all_same(longer[: len(item)], item):
                candidates.append((item, longer[len(item) : -1]))  # (tail recursion)
            if same_expr(longer[0], own) and _all_same(longer[extra:], item):
                candidates.append((item, longer[1:extra]))  # (left recursion)
    for item, separator in candidates:
        if not any(_references(expr, name) for expr in (*item, *separator)):
            return Sequence((*item, Repetition(Sequence((*separator, *item)), 0, None)))
    return body


def _references(expr: Expr, name: str) -> bool:
    """Whether ``expr`` references rule ``name`` itself (not through another rule)."""
    if isinstance(expr, RuleRef):
        return expr.name == name
    return any(_references(child, name) for child in children(expr))


def _items(expr: Expr) -> tuple[Expr, ...]:
    """A sequence's items, or the one item of anything else."""
    return expr.items if isinstance(expr, Sequence) else (expr,)


def _rewrite(expr: Expr) -> Expr:
    # (recursion: the parser bounds a rule's nesting by MAX_NESTING_DEPTH)
    if isinstance(expr, Sequence):
        # (a sequence stays a sequence, even of one list: a group in a sequence is a level)
        return Sequence(_fold([_rewrite(item) for item in expr.items]))
    if isinstance(expr, Choice):
        return Choice(tuple(_rewrite(option) for option in expr.options))
    if isinstance(expr, Repetition):
        return Repetition(_rewrite(expr.item), expr.min, expr.max)
    return expr


def _fold(items: list[Expr]) -> tuple[Expr, ...]:
    """A sequence's (rewritten) items with each repetition that repeats a separator and the
    items just before it folded into one separated repetition with them."""
    out: list[Expr] = []
    for item in items:
        if isinstance(item, Repetition):
            body = item.item.items if isinstance(item.item, Sequence) else (item.item,)
            for j in range(min(len(body), len(out)), 0, -1):  # (the longest item first)
                if all(same_expr(a, b) for a, b in zip(out[-j:], body[-j:], strict=True)):
                    high = None if item.max is None else item.max + 1
                    listed = SeparatedRepetition(tuple(out[-j:]), body[:-j], item.min + 1, high)
                    out[-j:] = [listed]
                    break
            else:
                out.append(item)
        else:
            out.append(item)
    return tuple(out)


def same_expr(a: Expr, b: Expr) -> bool:
    """Whether ``a`` and ``b`` are the same expression, rule references compared by name
    only (the same rule written in two places)."""
    if isinstance(a, RuleRef) and isinstance(b, RuleRef):
        return a.name == b.name
    if isinstance(a, Sequence) and isinstance(b, Sequence):
        return _all_same(a.items, b.items)
    if isinstance(a, Choice) and isinstance(b, Choice):
        return _all_same(a.options, b.options)
    if isinstance(a, Repetition) and isinstance(b, Repetition):
        return (a.min, a.max) == (b.min, b.max) and same_expr(a.item, b.item)
    if isinstance(a, SeparatedRepetition) and isinstance(b, SeparatedRepetition):
        return (
            (a.min, a.max) == (b.min, b.max)
            and _all_same(a.item, b.item)
            and _all_same(a.separator, b.separator)
        )
    if isinstance(a, _COMPOUND) or type(a) is not type(b):
        return False
    return a == b  # (leaves: literals, classes, any character)


_COMPOUND = (RuleRef, Sequence, Choice, Repetition, SeparatedRepetition)


def _all_same(a: tuple[Expr, ...], b: tuple[Expr, ...]) -> bool:
    return len(a) == len(b) and all(same_expr(x, y) for x, y in zip(a, b, strict=True))
