"""HTTP routes that plugins add (``chassis_register_routes``), and their accessors.

A plugin registers a :class:`fastapi.APIRouter` under a name; :func:`include_plugin_routes`
adds every registered router to the app after the built-in routes. The app's middleware
(API key, CORS, size bounds) and exception handlers are app-wide, so a plugin's routes are
guarded and answer errors exactly like the built-in ones. A handler reaches the engine with
:func:`get_engine`::

    from fastapi import APIRouter, Request
    from chassis.serve.plugin_routes import get_engine

    router = APIRouter()

    @router.get("/my_plugin/queue")
    async def queue(request: Request) -> dict:
        stats = get_engine(request).stats()
        return {"running": stats.num_running, "waiting": stats.num_waiting}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

    from chassis.plugins.registry import Registry
    from chassis.serve.state import ServerState

__all__ = ["get_engine", "get_server_state", "include_plugin_routes"]

_PARAM = re.compile(r"\{[^}]*\}")


def get_engine(request: Request) -> Any:
    """The engine the server runs (an :class:`~chassis.core.async_llm.AsyncLLM`: ``stats()``,
    ``stat_loggers``, ``generate(...)``, ``config``, ``model_name``, ``tokenizer``, ...)."""
    return get_server_state(request).engine


def get_server_state(request: Request) -> ServerState:
    """The server's shared state (:class:`~chassis.serve.state.ServerState`: ``engine``,
    ``settings``, ``model_name``, ``renderer``, ...)."""
    return request.app.state.chassis


def _paths(routes: Iterable[Any], prefix: str = "") -> Iterator[str]:
    """The paths ``routes`` serve, nested routers included (FastAPI >= 0.16x keeps an
    included router as one ``_IncludedRouter`` entry; older ones copy its routes)."""
    for route in routes:
        path = getattr(route, "path", None)
        if path is not None:
            yield prefix + path
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _paths(inner.routes, prefix + (getattr(context, "prefix", "") or ""))


def _route_key(path: str) -> str:
    # "/items/{id}" and "/items/{name}" match the same requests: compare them as one
    return _PARAM.sub("{}", path)


def include_plugin_routes(app: FastAPI, registry: Registry[Any] | None = None) -> list[str]:
    """Include every router of ``registry`` (default: the process's ``routes`` registry,
    filled by ``chassis_register_routes``) in ``app``, in name order; return their names.

    :raises ValueError: naming the plugin (and its distribution) when what it registered is
        not an ``APIRouter`` or cannot be imported, or when one of its routes has a path the
        app already serves (a built-in route, or another plugin's).
    """
    from chassis.plugins import PluginObjectError, get_plugin_manager, get_registries

    if registry is None:
        registry = get_registries().routes
    manager = get_plugin_manager()
    taken = {_route_key(path): "the server (a built-in route)" for path in _paths(app.routes)}
    included = []
    for name in registry.names():
        owner = registry.owner(name)
        where = (
            f"plugin {owner!r} (distribution {manager.distribution_of(owner)!r}) router {name!r}"
        )
        try:
            router = registry.get(name)
        except PluginObjectError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if not isinstance(router, APIRouter):
            raise ValueError(f"{where} is {router!r}, not a fastapi.APIRouter instance")
        paths = list(_paths(router.routes))
        for path in paths:
            other = taken.get(_route_key(path))
            if other is not None:
                raise ValueError(
                    f"{where} adds the route {path!r}, which {other} already serves; "
                    "give the plugin's routes their own prefix (e.g. '/<plugin name>/...')"
                )
        for path in paths:
            taken[_route_key(path)] = f"{where}"
        app.include_router(router)
        included.append(name)
    return included
