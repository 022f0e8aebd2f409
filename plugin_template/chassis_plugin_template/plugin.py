"""The general plugin: registers a scheduler, a sampler, a tool-call parser, a stat logger
and an HTTP route, adds a flag, adjusts the config.

Every hook here is a module-level function decorated with ``@hookimpl`` and named after a
hookspec in ``chassis.plugins.hookspecs``; a hookimpl may take any subset of the hookspec's
arguments (by name).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from chassis.plugins import hookimpl

if TYPE_CHECKING:
    import argparse

    from chassis.core.config import EngineConfig
    from chassis.plugins import Registry

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "template_sjf"
SAMPLER_NAME = "template_greedy"
TOOL_PARSER_NAME = "template_json_fence"
STAT_LOGGER_NAME = "template_counter"
ROUTER_NAME = "template"
#: ``config.plugin_args`` key of ``--template-greeting`` (the flag's argparse ``dest``)
GREETING_KEY = "template_greeting"
#: fallback for callers without a command line (the offline ``LLM`` class)
GREETING_ENV = "CHASSIS_TEMPLATE_GREETING"
DEFAULT_GREETING = "hello from chassis-plugin-template"


@hookimpl
def chassis_register_schedulers(registry: Registry[Any]) -> None:
    """Register ``template_sjf`` (shortest prompt first); select it with ``--scheduler``."""
    # A lazy "module:Class" string: the scheduler module (and the built-in it subclasses) is
    # imported only when someone selects it, so registering can never fail on an import.
    registry.register(
        SCHEDULER_NAME, "chassis_plugin_template.scheduler:ShortestPromptFirstScheduler"
    )


@hookimpl
def chassis_register_samplers(registry: Registry[Any]) -> None:
    """Register ``template_greedy`` (always the argmax); select it with ``--sampler``."""
    registry.register(SAMPLER_NAME, "chassis_plugin_template.sampler:TemplateGreedySampler")


@hookimpl
def chassis_register_tool_parsers(registry: Registry[Any]) -> None:
    """Register ``template_json_fence`` (calls in Markdown JSON blocks); select it with
    ``chassis serve --enable-auto-tool-choice --tool-call-parser template_json_fence``."""
    registry.register(TOOL_PARSER_NAME, "chassis_plugin_template.tool_parser:JsonFenceToolParser")


@hookimpl
def chassis_register_stat_loggers(registry: Registry[Any]) -> None:
    """Register ``template_counter`` (counts tokens and finished requests); select it with
    ``chassis serve --stat-loggers logging,template_counter``."""
    registry.register(STAT_LOGGER_NAME, "chassis_plugin_template.stats:TemplateCounterStatLogger")


@hookimpl
def chassis_register_routes(registry: Registry[Any]) -> None:
    """Add ``GET /template/stats`` to ``chassis serve`` (the router in ``routes.py``)."""
    # Lazy too: FastAPI and the route module load only in the API server, when it builds
    # its app, not in the engine core or the workers that also load this plugin.
    registry.register(ROUTER_NAME, "chassis_plugin_template.routes:router")


@hookimpl
def chassis_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--template-greeting`` to the engine commands."""
    # Prefix flags with the plugin's name: every plugin shares one parser.
    parser.add_argument(
        "--template-greeting",
        dest=GREETING_KEY,
        default=None,
        help=f"a greeting the template plugin logs at start-up (default: ${GREETING_ENV} "
        f"or {DEFAULT_GREETING!r})",
    )


@hookimpl
def chassis_configure(config: EngineConfig) -> None:
    """Store the effective greeting in ``config.plugin_args["template_greeting"]``.

    The flag wins, then ``$CHASSIS_TEMPLATE_GREETING``, then the default.

    :raises ValueError: the greeting is not a string.
    """
    greeting = config.plugin_args.get(GREETING_KEY)
    if greeting is None:
        greeting = os.environ.get(GREETING_ENV) or DEFAULT_GREETING
    if not isinstance(greeting, str):
        raise ValueError(f"--template-greeting must be a string; got {greeting!r}")
    config.plugin_args[GREETING_KEY] = greeting
    logger.info("chassis-plugin-template: %s", greeting)
