"""The process's registries, filled by the ``chassis_register_*`` hooks of loaded plugins."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from chassis.plugins.manager import PluginManager, get_plugin_manager
from chassis.plugins.registry import Registry


@dataclass(frozen=True)
class Registries:
    """One registry per pick-by-name kind of plugin object."""

    models: Registry[Any]
    attention_backends: Registry[Any]
    schedulers: Registry[Any]
    samplers: Registry[Any]
    tool_parsers: Registry[Any]
    reasoning_parsers: Registry[Any]
    structured_output_backends: Registry[Any]
    logits_processors: Registry[Any]
    stat_loggers: Registry[Any]
    #: name -> ``fastapi.APIRouter`` instance (not a class: every router is included)
    routes: Registry[Any]

    def items(self) -> list[tuple[str, Registry[Any]]]:
        """``(field name, registry)`` pairs, e.g. ``("schedulers", Registry(...))``."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


#: registry field -> the class every registered class must subclass
_BASES = {
    "models": "chassis.core.model_interface:CausalLM",
    "attention_backends": "chassis.core.attention:AttentionBackend",
    "schedulers": "chassis.core.scheduler_interface:Scheduler",
    "samplers": "chassis.core.sampler_interface:Sampler",
    "tool_parsers": "chassis.serve.tool_parser:ToolParser",
    "reasoning_parsers": "chassis.serve.reasoning_parser:ReasoningParser",
    "structured_output_backends": "chassis.core.structured_output:StructuredOutputBackend",
    "logits_processors": "chassis.core.logits_processor:LogitsProcessor",
    "stat_loggers": "chassis.core.stat_logger:StatLoggerBase",
}

#: registry field -> (hook that fills it, human-readable kind)
_HOOKS = {
    "models": ("chassis_register_models", "model architecture"),
    "attention_backends": ("chassis_register_attention_backends", "attention backend"),
    "schedulers": ("chassis_register_schedulers", "scheduler"),
    "samplers": ("chassis_register_samplers", "sampler"),
    "tool_parsers": ("chassis_register_tool_parsers", "tool-call parser"),
    "reasoning_parsers": ("chassis_register_reasoning_parsers", "reasoning parser"),
    "structured_output_backends": (
        "chassis_register_structured_output_backends",
        "structured-output backend",
    ),
    "logits_processors": ("chassis_register_logits_processors", "logits processor"),
    "stat_loggers": ("chassis_register_stat_loggers", "stat logger"),
    "routes": ("chassis_register_routes", "HTTP router"),
}


def build_registries(manager: PluginManager) -> Registries:
    """Load the general plugins of ``manager`` and let each fill the registries.

    Hooks run in plugin registration order; a registration that fails (a duplicate name, a
    malformed lazy string, an exception in the hook) raises
    :class:`~chassis.plugins.manager.PluginLoadError` naming the plugin, its distribution and
    the hook, with the original error as ``__cause__``.
    """
    manager.load_general_plugins()
    built: dict[str, Registry[Any]] = {}
    for field_name, (hook, kind) in _HOOKS.items():
        registry: Registry[Any] = Registry(kind, base=_BASES.get(field_name))
        for plugin_name, fn, argnames in manager.hookimpls(hook):
            # Attribute every name the hook registers to its plugin (``names_by``, errors).
            registry.current_owner = plugin_name
            manager.call_impl(plugin_name, hook, fn, argnames, registry=registry)
        registry.current_owner = "<direct>"
        built[field_name] = registry
    return Registries(**built)


def get_registries() -> Registries:
    """The registries of this process, built once (after loading the general plugins)."""
    manager = get_plugin_manager()
    with manager._lock:  # one build even when threads ask at once
        regs = manager.cache.get("registries")
        if regs is None:
            regs = build_registries(manager)
            manager.cache["registries"] = regs
        return regs
