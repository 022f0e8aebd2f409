"""``--middleware IMPORT_PATH`` (vLLM's flag): extra ASGI middleware named on the command line.

The path is ``package.module.Name`` (vLLM's form) or ``package.module:Name``. A class is
added with ``app.add_middleware(Name)`` (an ASGI middleware taking the app), an async
function ``(request, call_next)`` with ``app.middleware("http")``. They are added last, so
they run outermost, in the order given (the last one first). Anything else, or a path that
does not import, is a ``ValueError`` naming the flag; ``chassis serve`` checks them before
the model loads.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from fastapi import FastAPI


def import_middleware(path: str) -> Any:
    """The object ``path`` names; ``ValueError`` saying why it cannot be used."""
    module_name, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not name:
        raise ValueError(
            f"--middleware {path!r}: give an import path, 'package.module.Name' or "
            "'package.module:Name'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--middleware {path!r}: cannot import {module_name!r}: {exc}") from None
    try:
        middleware = getattr(module, name)
    except AttributeError:
        raise ValueError(f"--middleware {path!r}: {module_name!r} has no {name!r}") from None
    if not (inspect.isclass(middleware) or inspect.iscoroutinefunction(middleware)):
        raise ValueError(
            f"--middleware {path!r} names a {type(middleware).__name__!r} object: it must be "
            "an ASGI middleware class or an async function (request, call_next)"
        )
    return middleware


def add_user_middleware(app: FastAPI, paths: list[str]) -> None:
    """Add the middleware of ``paths`` to ``app`` (see the module docstring)."""
    for path in paths:
        middleware = import_middleware(path)
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
