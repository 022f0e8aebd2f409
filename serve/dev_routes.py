"""Development-mode routes: vLLM's ``VLLM_SERVER_DEV_MODE`` endpoints that chassis has.

Added only when ``VLLM_SERVER_DEV_MODE`` (or ``CHASSIS_SERVER_DEV_MODE``) is ``1`` or
``true`` (without it they do not exist: 404), as vLLM does: they change or reveal engine
state that production clients should not reach. They take the API key like every other
route.

``GET /server_info``: the engine's settings as it runs them (``engine_config``: every
``EngineConfig`` field, resolved: the model's local folder, ``max_model_len``, the
attention backend, ...) and what the engine core reported when it started
(``engine_info``: platform, KV blocks and capacity in tokens, ...), as JSON. vLLM answers
``{"vllm_config": ...}`` with its own config; the server's settings (the API key, TLS
files) are not shown.

``POST /reset_prefix_cache``: the engine forgets every cached prefix (between two steps;
running requests are not disturbed) and the route answers ``200`` with an empty body once it
has; later requests compute their prompts from scratch until their blocks are cached again.
Used to benchmark with a cold prefix cache. vLLM's query parameters
(``reset_running_requests``, ``reset_external``) are accepted and change nothing: running
requests keep their KV blocks either way, and there is no external KV cache.

Sleep mode (vLLM's routes; the engine needs ``--enable-sleep-mode``, else they answer 400
naming the flag; core/sleep_mode.py): ``POST /sleep?level=1`` (level 1 by default, or 2)
frees the KV cache and moves the weights to host memory (2: frees them) and answers ``200``
with an empty body once done, ``409`` while requests are unfinished (vLLM's ``mode``, which
aborts or drains them, is not read); ``POST /wake_up``
brings back the parts named by repeated ``tags`` (``?tags=weights&tags=kv_cache``; none:
both) and answers ``200`` once they are back; ``GET /is_sleeping`` answers
``{"is_sleeping": bool}``. A bad level or tag is a ``400`` naming ``level`` or ``tags``.
While the engine sleeps, generation requests get ``503`` ``engine_sleeping``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from chassis.core.sleep_mode import check_sleep_level, check_wake_tags
from chassis.serve import errors
from chassis.serve.env_flags import env_flag_set

logger = logging.getLogger(__name__)

#: the environment variables that add these routes (vLLM's, and chassis' own)
DEV_MODE_VARIABLES = ("VLLM_SERVER_DEV_MODE", "CHASSIS_SERVER_DEV_MODE")

router = APIRouter()


def server_dev_mode_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when either of :data:`DEV_MODE_VARIABLES` is ``1`` or ``true`` (any case)."""
    return env_flag_set(DEV_MODE_VARIABLES, environ)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Forget every prefix the engine has cached; 200 once done, 503 if the engine is dead."""
    state = request.app.state.chassis
    state.check_accepting()  # 503 while shutting down or with a dead engine
    await state.engine.reset_prefix_cache()  # its errors reach the app's handlers
    logger.info("prefix cache reset (POST /reset_prefix_cache)")
    return Response(status_code=200)


@router.get("/server_info")
async def server_info(request: Request) -> JSONResponse:
    """The engine's resolved settings and start-up report (see the module docstring)."""
    engine = request.app.state.chassis.engine
    info: Any = getattr(engine, "engine_info", None)
    report = None
    if info is not None:
        report = {**msgspec.to_builtins(info), "kv_capacity_tokens": info.kv_capacity_tokens}
    return JSONResponse(
        {"engine_config": msgspec.to_builtins(engine.config.to_dict()), "engine_info": report}
    )


@router.post("/sleep")
async def sleep(request: Request) -> Response:
    """Sleep mode: put the engine to sleep at ``?level=`` 1 (default) or 2; 200 once done."""
    state = request.app.state.chassis
    raw = request.query_params.get("level", "1")
    try:
        level = check_sleep_level(int(raw))
    except ValueError:
        message = f"level must be 1 or 2 (sleep levels); got {raw!r}"
        raise errors.bad_request(message, param="level") from None
    state.check_accepting()
    await state.engine.sleep(level)  # ValueError (sleep mode off): 400; busy: 409
    logger.info("engine asleep at level %d (POST /sleep)", level)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    """Sleep mode: bring back the parts the repeated ``?tags=`` name (none: all); 200 once
    they are back."""
    state = request.app.state.chassis
    tags = request.query_params.getlist("tags") or None  # vLLM: no tags = every part
    try:
        check_wake_tags(tags)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="tags") from None
    state.check_accepting()
    await state.engine.wake_up(tags)
    logger.info("engine woken up: %s (POST /wake_up)", ", ".join(tags or ["all"]))
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    """Sleep mode: ``{"is_sleeping": bool}``."""
    state = request.app.state.chassis
    state.check_accepting()
    return JSONResponse({"is_sleeping": bool(await state.engine.is_sleeping())})
