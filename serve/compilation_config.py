"""vLLM's ``-O`` and ``--compilation-config`` on the command line (engine flags).

The flags, as vLLM's releases spell them:

- ``-O N`` / ``-ON`` / ``-O=N`` / ``--optimization-level N``: vLLM's optimization level 0-3;
- ``--compilation-config JSON`` / ``-cc JSON``: a ``CompilationConfig`` as a JSON object (or
  an integer: its ``mode``); older vLLM took it as ``-O JSON`` too;
- dotted keys, ``-cc.KEY=VALUE``, ``-cc.KEY VALUE``, ``--compilation-config.KEY=VALUE`` and
  older vLLM's ``-O.KEY=VALUE``: one key each (the value is read as JSON, else as text;
  ``KEY+=a,b`` appends to a list), merged into one ``--compilation-config``;
- in a ``--config`` YAML file, ``compilation_config: {mode: 3}`` and ``optimization_level: 3``.

:func:`add_compilation_args` adds the two flags; argparse cannot read ``-O JSON`` nor the
dotted forms, so :func:`rewrite_compilation_args` turns those into the flags first (the
``chassis`` parser does it for every sub-command with engine flags, ``serve/cli.py``). A
flag given more than once is merged key by key; a key given twice with two values, invalid
JSON, an unknown key or a wrong value stops the command (argparse's error, exit status 2).
:func:`compilation_settings` then maps the values onto ``EngineConfig``'s settings
(:mod:`chassis.core.compilation_config`: the mapping, and the errors for chassis flags that
disagree with them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from chassis.core.compilation_config import (
    OPTIMIZATION_LEVELS,
    apply_compilation_request,
    compilation_request,
    read_compilation_config,
)

COMPILATION_CONFIG_FLAG = "--compilation-config"
OPTIMIZATION_LEVEL_FLAG = "--optimization-level"
#: the prefixes of the dotted form (``-cc.mode=3``)
_DOTTED_PREFIXES = ("-O.", "-cc.", COMPILATION_CONFIG_FLAG + ".")


def add_compilation_args(group: Any) -> None:
    """Add ``-O``/``--optimization-level`` and ``--compilation-config``/``-cc`` to ``group``
    (an argument group or parser)."""
    group.add_argument(
        "-O",
        OPTIMIZATION_LEVEL_FLAG,
        dest="optimization_level",
        type=int,
        choices=OPTIMIZATION_LEVELS,
        metavar="N",
        help="vLLM's optimization level: 0 = no compilation and no graphs (as "
        "--enforce-eager), 1-3 = --torch-compile with decode graphs; --compilation-config "
        "keys win over it (see docs/gpu.md)",
    )
    group.add_argument(
        COMPILATION_CONFIG_FLAG,
        "-cc",
        dest="compilation_config",
        type=_compilation_config_arg,
        action=_MergeCompilationConfig,
        metavar="JSON",
        help='vLLM\'s CompilationConfig, e.g. \'{"mode": 3, "cudagraph_capture_sizes": [1, 2, '
        "4]}' or -cc.cudagraph_mode=NONE; keys: mode (or level) 0-3 = compile or not, "
        "cudagraph_mode NONE = no graphs (other modes: chassis' decode graphs), "
        "cudagraph_capture_sizes, max_cudagraph_capture_size (see docs/gpu.md)",
    )


def rewrite_compilation_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with vLLM's spellings argparse cannot read turned into the two flags:
    ``-O3``/``-O=3``/``-O 3`` into ``--optimization-level 3``, ``-O JSON`` and ``-cc=JSON``
    into ``--compilation-config JSON``, and the dotted keys into one ``--compilation-config``
    after the others (before ``--``, whose positional arguments are kept as they are). Other
    tokens are kept. ``ValueError`` for a dotted key without a value or given twice with two
    values."""
    out: list[str] = []
    dotted: dict[str, Any] = {}
    tokens = list(argv)
    rest: list[str] = []  # from "--" on: positional arguments, kept as they are
    if "--" in tokens:
        tokens, rest = tokens[: tokens.index("--")], tokens[tokens.index("--") :]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        prefix = next((p for p in _DOTTED_PREFIXES if token.startswith(p)), None)
        if prefix is not None:
            path, has_value, text = token[len(prefix) :].partition("=")
            if not has_value:
                if i >= len(tokens):
                    raise ValueError(f"{token} needs a value: {token}=VALUE or {token} VALUE")
                text = tokens[i]
                i += 1
            _set_dotted(dotted, path, text, token)
        elif token == "-O":
            next_is_json = i < len(tokens) and tokens[i].lstrip().startswith("{")
            out.append(COMPILATION_CONFIG_FLAG if next_is_json else OPTIMIZATION_LEVEL_FLAG)
        elif token.startswith("-O") and not token.startswith("--"):
            value = token[3:] if token[2] == "=" else token[2:]
            is_json = value.lstrip().startswith("{")
            out += [COMPILATION_CONFIG_FLAG if is_json else OPTIMIZATION_LEVEL_FLAG, value]
        elif token.startswith("-cc="):
            out += [COMPILATION_CONFIG_FLAG, token[len("-cc=") :]]
        else:
            out.append(token)
    if dotted:
        out += [COMPILATION_CONFIG_FLAG, json.dumps(dotted)]
    return out + rest


def compilation_settings(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (the ``EngineConfig`` values of the flags given) with ``-O`` and
    ``--compilation-config`` applied; ``ValueError`` naming both flags when a chassis flag
    disagrees with them (``-O3 --enforce-eager``)."""
    level = getattr(args, "optimization_level", None)
    config = getattr(args, "compilation_config", None)
    if level is None and config is None:
        return settings
    return apply_compilation_request(compilation_request(config, level), settings)


def _compilation_config_arg(text: str) -> dict[str, Any]:
    """A ``--compilation-config`` value: a JSON object, or an integer (its ``mode``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"mode": value}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            "must be a JSON object of vLLM's CompilationConfig keys, e.g. '{\"mode\": 3}', "
            f"or a mode 0-3; got {text!r}"
        )
    return value


class _MergeCompilationConfig(argparse.Action):
    """Each ``--compilation-config`` adds its keys to the ones before (the dotted form gives
    one key at a time); the result is checked as a whole."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        merged = dict(getattr(namespace, self.dest, None) or {})
        for key, value in values.items():
            if key in merged and merged[key] != value:
                parser.error(
                    f"{COMPILATION_CONFIG_FLAG}: {key} given twice, as {merged[key]!r} and "
                    f"{value!r}; give it once"
                )
            merged[key] = value
        try:
            read_compilation_config(merged)
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, merged)


def _set_dotted(dotted: dict[str, Any], path: str, text: str, token: str) -> None:
    """Set ``a.b=value`` (``a.b+=x,y``: append) in ``dotted``, nested as vLLM nests it."""
    append = path.endswith("+")
    keys = path.removesuffix("+").split(".")
    if not all(keys):
        raise ValueError(f"{token}: a key is empty (write e.g. -cc.mode=3)")
    value = [_json_or_text(item) for item in text.split(",")] if append else _json_or_text(text)
    node = dotted
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"{token}: {key} is already given as {child!r}")
        node = child
    last = keys[-1]
    if append:
        before = node.get(last, [])
        if not isinstance(before, list):
            raise ValueError(f"{token}: {last} is already given as {before!r}, not a list")
        node[last] = before + value
    elif last in node and node[last] != value:
        raise ValueError(
            f"{token}: {'.'.join(keys)} is given twice, as {node[last]!r} and {value!r}; give "
            "it once"
        )
    else:
        node[last] = value


def _json_or_text(text: str) -> Any:
    """A dotted key's value: JSON where it parses (3, true, [1, 2]), else the text (NONE)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
