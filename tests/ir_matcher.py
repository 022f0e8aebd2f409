"""A tiny backtracking matcher of the structured-output IR, for tests only.

It reads the IR tree directly (no automaton), so tests can check a compiler's IR (JSON
schema, regex) independently of the automaton that the engine runs. Exponential in the
worst case: use it on short strings.
"""

from __future__ import annotations

import random

from chassis.builtin_plugins.structured_output import ir


def ir_fullmatch(node: ir.Node, data: bytes | str) -> bool:
    """Whether all of ``data`` (UTF-8 bytes, or a str to encode) matches ``node``."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return len(data) in _ends(node, data, 0)


def _ends(node: ir.Node, data: bytes, i: int) -> set[int]:
    """Every position where a match of ``node`` starting at ``i`` can end."""
    if isinstance(node, ir.Bytes):
        return {i + len(node.value)} if data.startswith(node.value, i) else set()
    if isinstance(node, ir.ByteSet):
        return {i + 1} if i < len(data) and data[i] in node.allowed else set()
    if isinstance(node, ir.Seq):
        current = {i}
        for item in node.items:
            current = {end for start in current for end in _ends(item, data, start)}
            if not current:
                break
        return current
    if isinstance(node, ir.Alt):
        return {end for option in node.options for end in _ends(option, data, i)}
    if isinstance(node, ir.Separated):
        # two sets of positions: nothing written yet (while all items so far were
        # optional), and something written (the next item needs its separator first)
        nothing, something = {i}, set()
        for item, required in node.items:
            starts = nothing | {e for p in something for e in _ends(node.separator, data, p)}
            written = {e for p in starts for e in _ends(item, data, p)}
            nothing, something = (set(), written) if required else (nothing, something | written)
        return nothing | something
    if isinstance(node, ir.Repeat) and node.separator is not None:
        return _ends(spelled_out(node), data, i)
    if isinstance(node, ir.Repeat):
        result = {i} if node.min == 0 else set()
        current, count = {i}, 0
        while current and (node.max is None or count < node.max):
            following = {end for start in current for end in _ends(node.item, data, start)}
            count += 1
            if following == current:
                # an item that matches the empty string: more rounds add nothing new, and
                # every further count (up to min) ends at the same positions
                result |= current
                break
            current = following
            if count >= node.min:
                result |= current
        return result
    raise TypeError(f"not an IR node: {node!r}")


def spelled_out(node: ir.Repeat) -> ir.Node:
    """A separated repetition as plain IR: ``item (separator item){min-1,max-1}``, or
    nothing at all as well when ``min`` is 0 (what the automaton builds in one copy)."""
    if node.max == 0:
        return ir.EMPTY
    assert node.separator is not None
    rest = ir.Repeat(
        ir.seq(node.separator, node.item),
        max(node.min - 1, 0),
        None if node.max is None else node.max - 1,
    )
    items = ir.seq(node.item, rest)
    return ir.alt(ir.EMPTY, items) if node.min == 0 else items


def ir_sample(
    node: ir.Node, rng: random.Random, *, extra: int = 2, up_to_bound: bool = False
) -> bytes:
    """A random text that ``node`` matches. A repetition runs ``min`` to ``min + extra``
    times (never above its ``max``), or, with ``up_to_bound``, up to its ``max`` when it has
    one."""
    if isinstance(node, ir.Bytes):
        return node.value
    if isinstance(node, ir.ByteSet):
        return bytes([rng.choice(sorted(node.allowed))])
    if isinstance(node, ir.Seq):
        return b"".join(ir_sample(i, rng, extra=extra, up_to_bound=up_to_bound) for i in node.items)
    if isinstance(node, ir.Alt):
        return ir_sample(rng.choice(node.options), rng, extra=extra, up_to_bound=up_to_bound)
    if isinstance(node, ir.Separated):
        written = [item for item, required in node.items if required or rng.random() < 0.5]
        parts = [ir_sample(item, rng, extra=extra, up_to_bound=up_to_bound) for item in written]
        separators = [
            ir_sample(node.separator, rng, extra=extra, up_to_bound=up_to_bound) for _ in parts
        ]
        return b"".join(
            sep + part if k else part
            for k, (sep, part) in enumerate(zip(separators, parts, strict=True))
        )
    if node.separator is not None:
        return ir_sample(spelled_out(node), rng, extra=extra, up_to_bound=up_to_bound)
    if node.max is None:
        high = node.min + extra
    else:
        high = node.max if up_to_bound else min(node.max, node.min + extra)
    count = rng.randint(node.min, high)
    return b"".join(
        ir_sample(node.item, rng, extra=extra, up_to_bound=up_to_bound) for _ in range(count)
    )
