"""Running the configuration hooks: plugin CLI flags in, adjusted ``EngineConfig`` out.

The engine commands (``chassis serve``, ``chassis bench``) and the offline ``LLM`` use these
helpers so every caller wires ``chassis_add_cli_args`` and ``chassis_configure`` the same way:

    dests = add_plugin_cli_args(parser)             # before parse_args
    args = parser.parse_args()
    config = EngineConfig(..., plugin_args=plugin_args_from(args, dests))
    apply_configure_hooks(config)                   # after the platform's check_and_update_config
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from chassis.plugins.manager import PluginManager, get_plugin_manager

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig


def add_plugin_cli_args(
    parser: argparse.ArgumentParser, manager: PluginManager | None = None
) -> list[str]:
    """Let every general plugin add its flags to ``parser``; return the ``dest`` they added.

    Loads the general plugins first. A hook that raises (for example ``argparse.ArgumentError``
    on a flag another plugin already added) becomes a
    :class:`~chassis.plugins.manager.PluginLoadError` naming the plugin.
    """
    manager = manager or get_plugin_manager()
    manager.load_general_plugins()
    before = {id(action) for action in parser._actions}
    manager.call_each("chassis_add_cli_args", parser=parser)
    return [
        action.dest
        for action in parser._actions
        if id(action) not in before and action.dest != argparse.SUPPRESS
    ]


def plugin_args_from(args: argparse.Namespace, dests: Iterable[str]) -> dict[str, Any]:
    """The parsed values of the plugin flags ``dests``, for ``EngineConfig.plugin_args``."""
    return {dest: getattr(args, dest) for dest in dests if hasattr(args, dest)}


def apply_configure_hooks(config: EngineConfig, manager: PluginManager | None = None) -> None:
    """Call every ``chassis_configure`` hookimpl on ``config``, in registration order.

    The config is re-validated after each plugin, so an invalid value is blamed on the plugin
    that set it.

    :raises PluginLoadError: a hook raised.
    :raises ValueError: a hook left the config invalid; the message names the plugin.
    """
    manager = manager or get_plugin_manager()
    manager.load_general_plugins()
    for plugin_name, fn, argnames in manager.hookimpls("chassis_configure"):
        manager.call_impl(plugin_name, "chassis_configure", fn, argnames, config=config)
        try:
            config.validate()
        except ValueError as exc:
            raise ValueError(
                f"plugin {plugin_name!r} from distribution "
                f"{manager.distribution_of(plugin_name)!r} left an invalid engine config in "
                f"chassis_configure: {exc}"
            ) from exc
