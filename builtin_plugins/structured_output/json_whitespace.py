"""The whitespace a JSON constraint allows between tokens, from vLLM's options.

``disable_any_whitespace`` asks for compact JSON: nothing between tokens (strings keep
their spaces). ``whitespace_pattern`` is a regex (the :mod:`.regex` subset) for each run
between tokens; it may match JSON whitespace only (space, tab, newline, carriage return),
so that every output still parses. Neither set: :data:`~.json_syntax.WS`, runs of at most
:data:`~.json_syntax.MAX_WHITESPACE` bytes.
"""

from __future__ import annotations

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_syntax import WHITESPACE_BYTES, WS
from chassis.builtin_plugins.structured_output.regex import regex_to_ir
from chassis.core.structured_output import StructuredOutputsParams

__all__ = ["whitespace_node"]


def whitespace_node(params: StructuredOutputsParams) -> ir.Node:
    """The IR of one whitespace run between tokens for ``params``' JSON constraint;
    ``ValueError`` for a ``whitespace_pattern`` the regex front end refuses or one that can
    match a byte JSON does not allow there."""
    if params.disable_any_whitespace:
        return ir.EMPTY
    if params.whitespace_pattern is None:
        return WS
    try:
        node = regex_to_ir(params.whitespace_pattern)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.whitespace_pattern: {exc}") from None
    stray = _bytes_outside(node, WHITESPACE_BYTES)
    if stray:
        shown = ", ".join(repr(chr(b)) for b in sorted(stray)[:5])
        raise ValueError(
            "structured_outputs.whitespace_pattern may match only JSON whitespace (space, "
            f"\\t, \\n, \\r; e.g. '[ \\n]{{0,8}}'); it can match {shown}"
        )
    return node


def _bytes_outside(node: ir.Node, allowed: frozenset[int]) -> set[int]:
    """The bytes some string ``node`` matches holds that are not in ``allowed``."""
    stray: set[int] = set()
    seen: set[int] = set()
    pending = [node]
    while pending:  # (iterative, memoised by identity: the IR may share sub-trees)
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ir.Bytes):
            stray.update(b for b in current.value if b not in allowed)
        elif isinstance(current, ir.ByteSet):
            stray.update(current.allowed - allowed)
        elif isinstance(current, ir.Seq):
            pending.extend(current.items)
        elif isinstance(current, ir.Alt):
            pending.extend(current.options)
        elif isinstance(current, ir.Repeat):
            pending.append(current.item)
            if current.separator is not None:
                pending.append(current.separator)
        else:  # ir.Separated
            pending.extend(item for item, _ in current.items)
            pending.append(current.separator)
    return stray
