"""The plugin contract: hookspecs, entry-point loading, and the registries they fill."""

from chassis.plugins.config_hooks import (
    add_plugin_cli_args,
    apply_configure_hooks,
    plugin_args_from,
)
from chassis.plugins.hookspecs import hookimpl, hookspec
from chassis.plugins.manager import (
    GENERAL_GROUP,
    PLATFORM_GROUP,
    PluginLoadError,
    PluginManager,
    get_plugin_manager,
    load_general_plugins,
    register_plugin,
    set_plugin_manager,
)
from chassis.plugins.registries import Registries, get_registries
from chassis.plugins.registry import (
    DuplicateNameError,
    PluginObjectError,
    Registry,
    UnknownNameError,
)

#: Version of the plugin contract. Minor bumps add hooks or keyword arguments; a major bump
#: (never silently) removes or changes one.
PLUGIN_API_VERSION = "1.1"

__all__ = [
    "GENERAL_GROUP",
    "PLATFORM_GROUP",
    "PLUGIN_API_VERSION",
    "DuplicateNameError",
    "PluginLoadError",
    "PluginManager",
    "PluginObjectError",
    "Registries",
    "Registry",
    "UnknownNameError",
    "add_plugin_cli_args",
    "apply_configure_hooks",
    "get_plugin_manager",
    "get_registries",
    "hookimpl",
    "hookspec",
    "load_general_plugins",
    "plugin_args_from",
    "register_plugin",
    "set_plugin_manager",
]
