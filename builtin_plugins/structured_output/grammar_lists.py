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

The nesting the rewritten rule counts (:func:`~.grammar_parser.nesting_cost`) is the
written one's: the separated repetition is one level, as the repeated group was, and its
items are inside it as the group's were. What a ``(...)?`` around a list adds is folded in
the IR instead (:mod:`.grammar`), so the grammar's nesting stays as written.
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
)

__all__ = ["same_expr", "separated_lists"]


def separated_lists(rules: dict[str, Rule]) -> dict[str, Rule]:
    """``rules`` with every ``item (separator item){m,n}`` shape of their sequences written
    as a :class:`~.grammar_parser.SeparatedRepetition` (see the module docstring). The
    rules derive the same texts as before. Linear in the grammar's size times its nesting
    (which the parser bounds)."""
    return {name: replace(rule, body=_rewrite(rule.body)) for name, rule in rules.items()}


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
