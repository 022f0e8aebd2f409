"""``--config FILE``: flags read from a YAML file (vLLM's ``--config``).

The file is a mapping of flag names to values, written as the flags are (``port``,
``max-model-len``) or with underscores (``max_model_len``), plus ``model``::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    port: 8000
    max_model_len: 2048
    enable_prefix_caching: false
    served_model_name: [smol, default]
    speculative_config: {method: ngram, num_speculative_tokens: 4}

A flag given on the command line wins over the file's value. Values become flag arguments:
``true`` the bare flag, ``false`` the ``--no-`` form where the flag has one (and nothing
where false is the default), a list one flag with several values, a mapping its JSON (the
JSON flags), anything else its text. A key that names no flag of the sub-command, a
file that cannot be read or is not a mapping, and a value the flag refuses are errors
naming the file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

#: the dest of ``--config`` (a file may not name it)
CONFIG_DEST = "config"


def load_config_file(path: str) -> dict[str, Any]:
    """The mapping in the YAML file at ``path``; ``ValueError`` saying what is wrong."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(
            f"--config {path}: must be a mapping of flag names to values "
            "(e.g. 'port: 8000'), not a YAML " + type(data).__name__
        )
    return data


def _given(parser: argparse.ArgumentParser, action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether the command line set ``action``'s value: passed one of its option strings, or
    of another flag with the same destination (``--disable-log-stats`` and
    ``--stat-loggers``)."""
    names = {
        name
        for other in parser._actions
        if other.dest == action.dest
        for name in other.option_strings
    }
    for token in argv:
        name = token.split("=", 1)[0] if token.startswith("--") else token
        if name in names:
            return True
    return False


def _tokens(flag: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    """The command-line tokens that pass ``value`` to ``flag``."""
    if action.nargs == 0:  # store_true, store_const, BooleanOptionalAction
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {flag} is a switch: give true or false")
        if value:
            return [flag]
        negative = "--no-" + flag[2:]
        return [negative] if negative in action.option_strings else []
    if isinstance(value, bool):
        value = str(value).lower()
    if isinstance(value, dict):
        return [f"{flag}={json.dumps(value)}"]
    if isinstance(value, list):
        if action.nargs not in ("+", "*") and not isinstance(action.nargs, int):
            raise ValueError(f"--config {path}: {flag} takes one value, not a list")
        return [flag, *(str(v) for v in value)]
    return [f"{flag}={value}"]


def config_file_argv(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> list[str]:
    """The tokens to append to ``argv`` (the sub-command's command line, parsed by
    ``parser`` into ``args``) for the file named by ``args.config``: one per key whose flag
    the command line does not give. ``ValueError`` for an unknown key."""
    path = getattr(args, CONFIG_DEST)
    extra: list[str] = []
    for key, value in load_config_file(path).items():
        if key == CONFIG_DEST:
            raise ValueError(f"--config {path}: a config file cannot name another (config)")
        if key == "model":
            if getattr(args, "model", None) is None and getattr(args, "model_flag", None) is None:
                extra.append(f"--model={value}")
            continue
        flag = "--" + key.replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None:
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command (see --help)")
        if not _given(parser, action, argv) and value is not None:
            extra.extend(_tokens(flag, action, value, path))
    return extra
