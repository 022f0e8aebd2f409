"""The plugin contract of chassis: every hook a plugin may implement.

This module is the plugin author's manual. A plugin is any module or object that defines
functions decorated with :data:`hookimpl` and named after the hooks below, exposed through one
of the two entry-point groups:

* ``chassis.platform_plugins`` -- loaded lazily, when ``current_platform`` is first read,
  in every process. Implements :func:`chassis_platform` and nothing else.
* ``chassis.general_plugins`` -- loaded once per process (API server, engine core, workers)
  before any registry is read. Implements any of the other hooks (never
  :func:`chassis_platform`).

The entry-point name is the plugin's name (in ``CHASSIS_PLUGINS``, ``chassis plugins`` and
errors); it must be unique across installed distributions and both groups. A plugin that
fails to import, a hookimpl that matches no hookspec or asks for an unknown argument, a
``chassis_*`` function without ``@hookimpl``, or a hook wrapper stops start-up with a
:class:`chassis.plugins.PluginLoadError` naming the distribution, entry point and hook.

Compatibility promise (``PLUGIN_API_VERSION``): hookspecs only ever *gain* keyword arguments.
pluggy calls a hookimpl with the subset of arguments it names, so a plugin written against an
older version keeps working. Removing or renaming a hook or an argument bumps the major
version of :data:`chassis.plugins.PLUGIN_API_VERSION`.

All registration hooks are 1:N: every plugin that implements one is called, and the results
are collected. Choices made by name (``--scheduler fcfs``) are then looked up in the
registries that those hooks filled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from chassis.core.config import EngineConfig
    from chassis.platforms.interface import Platform
    from chassis.plugins.registry import Registry

PROJECT_NAME = "chassis"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorate a plugin's hook functions with this marker.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Platform discovery (group ``chassis.platform_plugins``)
# ---------------------------------------------------------------------------------------------


@hookspec
def chassis_platform() -> type[Platform] | None:
    """Offer this plugin's platform, if its device is usable in this process.

    Called once per process when ``chassis.platforms.current_platform`` is first resolved.
    Detection must be cheap and must not initialise the device in a way that breaks forking.

    :return: a :class:`chassis.platforms.Platform` subclass when the device is present and
        usable, else ``None``. Raising is an error that stops start-up (it is never taken as
        "not available").

    1:N -- every implementation is called. Out-of-tree platforms win over the built-in ones;
    two active out-of-tree platforms is an error (set ``CHASSIS_PLATFORM`` to pick one).
    """


# ---------------------------------------------------------------------------------------------
# Registries (group ``chassis.general_plugins``)
# ---------------------------------------------------------------------------------------------


@hookspec
def chassis_register_models(registry: Registry[Any]) -> None:
    """Add model architectures.

    :param registry: maps an architecture name, exactly as in HF ``config.architectures``
        (``"LlamaForCausalLM"``), to a :class:`chassis.core.model_interface.CausalLM`
        subclass or to a lazy ``"package.module:Class"`` string imported on first use.
    :return: nothing; call ``registry.register(name, obj)``.

    1:N. Registering a name that is already taken is an error naming both owners.
    """


@hookspec
def chassis_register_attention_backends(registry: Registry[Any]) -> None:
    """Add attention backends.

    :param registry: maps a backend name (``"torch_paged"``) to a
        :class:`chassis.core.attention.AttentionBackend` subclass or a lazy
        ``"module:Class"`` string. Selected with ``--attention-backend``; without it the
        platform's :meth:`Platform.default_attention_backend` names the backend.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_schedulers(registry: Registry[Any]) -> None:
    """Add schedulers.

    :param registry: maps a scheduler name (built-ins: ``"fcfs"``, ``"priority"``) to a
        :class:`chassis.core.scheduler_interface.Scheduler` subclass or a lazy string.
        Selected with ``--scheduler``.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_samplers(registry: Registry[Any]) -> None:
    """Add samplers.

    :param registry: maps a sampler name (built-in: ``"default"``) to a
        :class:`chassis.core.sampler_interface.Sampler` subclass or a lazy string.
        Selected with ``--sampler``.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_tool_parsers(registry: Registry[Any]) -> None:
    """Add tool-call parsers (selected with ``--tool-call-parser``).

    :param registry: maps a parser name (built-ins: ``"hermes"``, ``"llama3_json"``,
        ``"mistral"``, ``"pythonic"``) to a :class:`chassis.serve.tool_parser.ToolParser`
        subclass or a lazy string. The API server builds one instance per choice of a request
        it parses (see that class for the streaming contract).
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_reasoning_parsers(registry: Registry[Any]) -> None:
    """Add reasoning parsers (selected with ``--reasoning-parser``).

    :param registry: maps a parser name (built-ins: ``"qwen3"``, ``"deepseek_r1"``) to a
        :class:`chassis.serve.reasoning_parser.ReasoningParser` subclass or a lazy string. The
        API server builds one instance per choice of every chat completion.
    :return: nothing.

    1:N.
    """


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@hookspec
def chassis_register_structured_output_backends(registry: Registry[Any]) -> None:
    """Add structured-output (constrained decoding) backends.

    :param registry: maps a backend name (built-in: ``"chassis"``) to a
        :class:`chassis.core.structured_output.StructuredOutputBackend` subclass or a lazy
        string. Selected with ``--structured-output-backend``. The engine core builds one
        instance, with the tokenizer's vocabulary, when the first request asks for
        structured output; the API server calls the class's ``check`` to validate requests.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_logits_processors(registry: Registry[Any]) -> None:
    """Add logits processors (selected with ``--logits-processors a,b``; none by default).

    :param registry: maps a processor name (built-in: ``"no_repeat_ngram"``) to a
        :class:`chassis.core.logits_processor.LogitsProcessor` subclass or a lazy
        ``"module:Class"`` string. ``--logits-processors`` also accepts a qualified
        ``"package.module:Class"`` that no plugin registered (vLLM's form). Each model runner
        builds one instance of every selected class with ``(config, device, pin_memory)``,
        calls its ``update_state(batch_update)`` before every step and its
        ``apply(logits, rows)`` on the rows that sample; the front-end calls the classmethod
        ``validate_params(params)`` on every request (a ``ValueError`` is the client's 400).
        Per-request arguments travel in ``SamplingParams.extra_args`` (the API's
        ``vllm_xargs``). The class documents the full contract.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add a plugin's own flags to ``chassis serve`` (and the other engine commands).

    :param parser: the ``argparse`` parser of the sub-command. Use flag names prefixed with
        the plugin's name to avoid clashes; the parsed values reach
        :func:`chassis_configure` through ``config.plugin_args``.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_configure(config: EngineConfig) -> None:
    """Adjust the final engine configuration before the engine starts.

    Called once, in the process that builds the config, after the CLI (or the ``LLM``
    keyword arguments) and the platform's ``check_and_update_config`` have been applied.

    :param config: the mutable :class:`chassis.core.config.EngineConfig`; change fields in
        place. ``config.plugin_args`` holds the values of flags added by
        :func:`chassis_add_cli_args`.
    :return: nothing.

    1:N, called in plugin registration order.
    """


# ---------------------------------------------------------------------------------------------
# The front-end: statistics and HTTP routes (API-server process)
# ---------------------------------------------------------------------------------------------


@hookspec
def chassis_register_stat_loggers(registry: Registry[Any]) -> None:
    """Add stat loggers (selected with ``--stat-loggers a,b``; default ``logging``).

    :param registry: maps a logger name (built-in: ``"logging"``, vLLM's periodic throughput
        line) to a :class:`chassis.core.stat_logger.StatLoggerBase` subclass or a lazy
        ``"module:Class"`` string. The front-end process (the API server's ``AsyncLLM``, the
        offline ``LLM`` when ``stat_loggers`` names some) builds one instance per selected
        name with a :class:`chassis.core.stat_logger.StatLoggerInfo`, calls its ``record``
        with every engine step's scheduler and iteration stats, its ``log`` every
        ``--stat-log-interval`` seconds and its ``shutdown`` at the end. A logger that
        raises is logged once and disabled; the engine keeps serving.
    :return: nothing.

    1:N.
    """


@hookspec
def chassis_register_routes(registry: Registry[Any]) -> None:
    """Add HTTP routes to the OpenAI-compatible server (``chassis serve``).

    :param registry: maps a router name (usually the plugin's name) to a
        :class:`fastapi.APIRouter` instance or a lazy ``"module:attribute"`` string naming
        one. Every registered router is included in the app after the built-in routes, so
        its routes get the same API-key check (every path but ``/health``), the same
        OpenAI-shaped error responses and the same request-size bounds. A route handler
        reaches the engine through :func:`chassis.serve.plugin_routes.get_engine`
        (``get_engine(request)``). A route whose path the server already serves (a built-in
        one, or another plugin's) stops start-up with an error naming the plugin.
    :return: nothing.

    1:N.
    """
