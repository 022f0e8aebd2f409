"""Every flag of every ``chassis`` command and ``chassis bench`` kind says what it is in
``--help`` (several bench flags printed only their name)."""

from __future__ import annotations

import argparse

from chassis.serve.cli import build_parser


def _parsers(
    parser: argparse.ArgumentParser, name: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found.extend(_parsers(sub, f"{name} {sub_name}"))
    return found


def test_every_flag_has_a_help_text() -> None:
    missing = [
        f"{name} {action.option_strings[-1]}"
        for name, parser in _parsers(build_parser(), "chassis")
        for action in parser._actions
        if action.option_strings and not action.help
    ]
    assert missing == []
