"""The ``chassis`` command: one sub-command per module, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

#: sub-command name -> module with ``add_parser(subparsers)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "serve": "chassis.serve.cli_serve",
    "env": "chassis.serve.cli_env",
    "plugins": "chassis.serve.cli_plugins",
    "bench": "chassis.serve.cli_bench",
}


class ChassisArgumentParser(argparse.ArgumentParser):
    """The parser of ``chassis`` and its sub-commands: a sub-command with engine flags first
    turns vLLM's ``-O`` and dotted ``--compilation-config`` spellings into flags argparse
    reads (:func:`chassis.serve.compilation_config.rewrite_compilation_args`)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        from chassis.serve.compilation_config import (
            COMPILATION_CONFIG_FLAG,
            rewrite_compilation_args,
        )

        if args is not None and COMPILATION_CONFIG_FLAG in self._option_string_actions:
            try:
                args = rewrite_compilation_args(args)
            except ValueError as exc:
                self.error(str(exc))
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = ChassisArgumentParser(
        prog="chassis", description="chassis: a plugin-first LLM inference and serving engine"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default: INFO); goes before the sub-command",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # sub-command not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; its exit status (2: no sub-command given).

    A plugin that fails to load (or registered a class that does not import or is of the
    wrong kind), or a platform that cannot be chosen, ends the command with
    the error's message (which names the plugin and the cause) and exit status 1;
    ``--log-level DEBUG`` adds the traceback.
    """
    from chassis.platforms.resolve import PlatformError
    from chassis.plugins.manager import PluginLoadError
    from chassis.plugins.registry import PluginObjectError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "config", None):
            args = _with_config_file(parser, args, list(sys.argv[1:] if argv is None else argv))
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`chassis plugins --json | head`): stop quietly, and keep
        # Python's final flush of stdout from raising again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (PluginLoadError, PluginObjectError, PlatformError) as exc:
        logging.getLogger(__name__).debug("start-up failed", exc_info=True)
        print(f"chassis: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _with_config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> argparse.Namespace:
    """``args`` again, with the flags of ``--config``'s file that the command line leaves
    out (:mod:`chassis.serve.config_file`); a bad file ends the command (exit status 2)."""
    from chassis.serve.args import ENGINE_PARSER_DEST
    from chassis.serve.compilation_config import rewrite_compilation_args
    from chassis.serve.config_file import config_file_argv

    command_parser = getattr(args, ENGINE_PARSER_DEST)
    try:
        # (-O3 on the command line is --optimization-level's: the file's value must not win)
        extra = config_file_argv(command_parser, args, rewrite_compilation_args(argv))
    except ValueError as exc:
        command_parser.error(str(exc))
    return parser.parse_args([*argv, *extra])


if __name__ == "__main__":
    sys.exit(main())
