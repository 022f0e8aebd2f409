"""vLLM's (older) ``structural_tag`` response format compiled to the structured-output IR.

The format::

    {"type": "structural_tag",
     "structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}, ...],
     "triggers": ["<function="]}

The output is free text with tagged JSON inside:

- free text is any text that contains no trigger;
- where a trigger appears, a structure starts there: the text must go on as the ``begin``
  of a structure that starts with that trigger, then a JSON value valid against its
  ``schema`` (written as for a JSON-schema constraint: no whitespace around the value),
  then its ``end``; free text follows again, scanned afresh (a trigger that would start
  inside ``end`` and finish in the text after it is not one);
- the output may end anywhere in free text (a partial trigger such as ``<fun`` included),
  but not inside a structure.

So a trigger never appears in the output except as the start of a structure. To keep this
a small regular expression, triggers must: start with an ASCII character that occurs
nowhere else inside any trigger (``<`` in ``<function=`` and ``<tool_call>``); not be a
prefix of one another; and every ``begin`` must start with a trigger. Other shapes (the
newer ``format`` field) are refused.
"""

from __future__ import annotations

import json
from typing import Any

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_syntax import NOTHING, either, join
from chassis.core.structured_nesting import check_json_text_nesting

__all__ = ["structural_tag_to_ir"]


def structural_tag_to_ir(text: str) -> ir.Node:
    """The outputs the structural tag (its JSON ``text``) allows; ``ValueError`` saying what
    is wrong for a malformed or unsupported one, or a schema the backend refuses."""
    from chassis.builtin_plugins.structured_output.json_schema import schema_to_ir

    spec = _load(text)
    triggers = _triggers(spec)
    structures = []
    for i, structure in enumerate(spec["structures"]):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(structure, dict):
            raise ValueError(f"{where} must be an object with begin, schema and end")
        begin, end = structure.get("begin"), structure.get("end", "")
        if not isinstance(begin, str) or not begin:
            raise ValueError(f"{where}.begin must be a non-empty string")
        if not isinstance(end, str):
            raise ValueError(f"{where}.end must be a string")
        if not any(begin.startswith(trigger) for trigger in triggers):
            raise ValueError(
                f"{where}.begin {begin!r} does not start with any trigger, so it could never "
                f"be written; triggers: {triggers}"
            )
        if "schema" not in structure:
            raise ValueError(f"{where} needs a JSON schema ('schema')")
        try:
            body = schema_to_ir(structure["schema"])
        except ValueError as exc:
            raise ValueError(f"{where}.schema: {exc}") from None
        structures.append(join(ir.literal(begin), body, ir.literal(end)))
    free = _free_text(triggers)
    return ir.seq(free, ir.Repeat(ir.seq(either(*structures), free), 0, None))


def _load(text: str) -> dict[str, Any]:
    check_json_text_nesting(text, "structural_tag")
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be an object")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag type must be 'structural_tag'; got {spec['type']!r}")
    if "format" in spec:
        raise ValueError(
            "the structural_tag 'format' shape is not supported; give 'structures' "
            "([{'begin', 'schema', 'end'}]) and 'triggers'"
        )
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    return spec


def _triggers(spec: dict[str, Any]) -> list[str]:
    triggers = spec.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    triggers = list(dict.fromkeys(triggers))
    firsts = {trigger[0] for trigger in triggers}
    for trigger in triggers:
        if not trigger[0].isascii():
            raise ValueError(
                f"structural_tag trigger {trigger!r} must start with an ASCII character"
            )
        inside = firsts.intersection(trigger[1:])
        if inside:
            raise ValueError(
                f"structural_tag trigger {trigger!r} contains {sorted(inside)[0]!r}, which "
                "starts a trigger: a trigger's first character may not appear inside any "
                "trigger"
            )
        for other in triggers:
            if other != trigger and other.startswith(trigger):
                raise ValueError(
                    f"structural_tag trigger {trigger!r} is a prefix of trigger {other!r}"
                )
    return triggers


def _free_text(triggers: list[str]) -> ir.Node:
    """Text in which no trigger occurs: runs without any trigger's first character, and
    blocks from such a character to the next one that do not start with a trigger."""
    firsts = sorted({ord(trigger[0]) for trigger in triggers})
    plain = ir.Repeat(ir.unicode_char(excluded_ascii=firsts), 0, None)
    blocks = []
    for first in firsts:
        rests = [trigger[1:] for trigger in triggers if ord(trigger[0]) == first]
        blocks.append(join(ir.Bytes(bytes([first])), _not_starting_with(rests, firsts, plain)))
    block = either(*blocks)
    return plain if block == NOTHING else ir.seq(plain, ir.Repeat(block, 0, None))


def _not_starting_with(words: list[str], excluded: list[int], plain: ir.Node) -> ir.Node:
    """Text without the ``excluded`` (ASCII) characters that starts with none of ``words``
    (:data:`NOTHING` if one of them is empty: every text starts with it).

    Built over the trie of ``words`` from its leaves up, without recursion: a trie is as
    deep as the longest word, and a trigger's length is not a nesting limit."""
    # the trie's nodes in pre-order: (the rests of the words through it, its children)
    nodes: list[tuple[list[str], dict[str, int]]] = []
    pending = [(words, -1, "")]
    while pending:
        rests, parent, char = pending.pop()
        index = len(nodes)
        nodes.append((rests, {}))
        if parent >= 0:
            nodes[parent][1][char] = index
        if any(not word for word in rests):
            continue  # NOTHING: its children do not matter
        children: dict[str, list[str]] = {}
        for word in rests:
            children.setdefault(word[0], []).append(word[1:])
        # reversed, so that children are numbered (and their options joined) in order
        pending.extend((tails, index, c) for c, tails in reversed(children.items()))
    built: list[ir.Node] = [NOTHING] * len(nodes)
    for index in range(len(nodes) - 1, -1, -1):  # children come after their parent
        rests, children_at = nodes[index]
        if any(not word for word in rests):
            continue
        starts = {word[0] for word in rests}
        other = ir.codepoint_ranges(
            ir.complement([(code, code) for code in excluded] + [(ord(c), ord(c)) for c in starts])
        )
        options = [ir.EMPTY, ir.seq(other, plain)]
        for char in dict.fromkeys(word[0] for word in rests):
            options.append(join(ir.literal(char), built[children_at[char]]))
        built[index] = either(*options)
    return built[0]
