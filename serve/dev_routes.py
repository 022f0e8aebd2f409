"""Development-mode routes: vLLM's ``VLLM_SERVER_DEV_MODE`` endpoints that chassis has.

Added only when ``VLLM_SERVER_DEV_MODE`` (or ``CHASSIS_SERVER_DEV_MODE``) is ``1`` or
``true`` (without it they do not exist: 404), as vLLM does: they change or reveal engine
state that production clients should not reach. They take the API key like every other
route.

``GET /server_info``: the engine's settings as it runs them (``engine_config``: every
``EngineConfig`` field, resolved: the model's local folder, ``max_model_len``, the
attention backend, ...) and what the engine core reported when it started
(``engine_info``: platform, KV blocks and capacity in tokens, ...; engine 0's with
``--data-parallel-size``), each engine's report (``engines``, one per data-parallel engine)
and their KV capacity together (``total_kv_capacity_tokens``), as JSON. vLLM answers
``{"vllm_config": ...}`` with its own config; the server's settings (the API key, TLS
files) are not shown.

``POST /reset_prefix_cache``: the engine forgets every cached prefix (between two steps;
running requests are not disturbed) and the route answers ``200`` with an empty body once it
has; later requests compute their prompts from scratch until their blocks are cached again.
Used to benchmark with a cold prefix cache. vLLM's query parameters
(``reset_running_requests``, ``reset_external``) are accepted and change nothing: running
requests keep their KV blocks either way, and there is no external KV cache.

Sleep mode (vLLM's routes; the engine needs ``--enable-sleep-mode``, else they answer 400
naming the flag; core/sleep_mode.py): ``POST /sleep?level=1&mode=abort`` (level 1 by
default, or 2) frees the KV cache and moves the weights to host memory (2: frees them) and
answers ``200`` with an empty body once done; ``mode`` (vLLM's) says what happens to
unfinished requests first: ``abort`` (default) ends them, ``wait`` lets them finish (the
answer comes once they have and the engine sleeps), ``keep`` answers ``409`` when there are
any; ``POST /wake_up``
brings back the parts named by repeated ``tags`` (``?tags=weights&tags=kv_cache``; none:
both) and answers ``200`` once they are back; ``GET /is_sleeping`` answers
``{"is_sleeping": bool}``. A bad level or tag is a ``400`` naming ``level`` or ``tags``.
While the engine sleeps, generation requests get ``503`` ``engine_sleeping``.

Pausing generation (vLLM's RLHF routes; core/pause_state.py): ``POST
/pause?mode=abort&clear_cache=true`` stops starting requests (those made meanwhile wait)
after ending the unfinished ones (``abort``, default), letting them finish (``wait``: the
answer comes once they have) or freezing them (``keep``), and answers ``{"status":
"paused"}``; ``POST /resume`` answers ``{"status": "resumed"}``; ``GET /is_paused``
answers ``{"is_paused": bool}``. A bad mode or ``clear_cache`` is a ``400`` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from chassis.core.pause_state import PauseMode, check_pause_mode
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
    infos: list[Any] = getattr(engine, "engine_infos", None) or ([] if info is None else [info])
    reports = [_engine_report(i) for i in infos]
    body: dict[str, Any] = {
        "engine_config": msgspec.to_builtins(engine.config.to_dict()),
        "engine_info": None if info is None else _engine_report(info),
    }
    if reports:  # data parallelism: each engine, and what they hold together
        body["engines"] = reports
        body["total_kv_capacity_tokens"] = sum(r["kv_capacity_tokens"] for r in reports)
    return JSONResponse(body)


def _engine_report(info: Any) -> dict[str, Any]:
    """One engine core's start-up report, with its KV capacity in tokens."""
    return {**msgspec.to_builtins(info), "kv_capacity_tokens": info.kv_capacity_tokens}


@router.post("/sleep")
async def sleep(request: Request) -> Response:
    """Sleep mode: put the engine to sleep at ``?level=`` 1 (default) or 2, after ending,
    awaiting or refusing unfinished requests by ``?mode=``; 200 once asleep."""
    state = request.app.state.chassis
    raw = request.query_params.get("level", "1")
    try:
        level = check_sleep_level(int(raw))
    except ValueError:
        message = f"level must be 1 or 2 (sleep levels); got {raw!r}"
        raise errors.bad_request(message, param="level") from None
    mode = _mode(request)
    state.check_accepting()
    await state.engine.sleep(level, mode)  # ValueError (sleep mode off): 400; busy: 409
    logger.info("engine asleep at level %d (POST /sleep, mode %s)", level, mode)
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


@router.post("/pause")
async def pause(request: Request) -> JSONResponse:
    """Pause generation (``?mode=`` abort, wait or keep; ``?clear_cache=`` true or false)."""
    state = request.app.state.chassis
    mode = _mode(request)
    raw = request.query_params.get("clear_cache", "true")
    if raw.lower() not in ("true", "false", "1", "0"):
        message = f"clear_cache must be true or false; got {raw!r}"
        raise errors.bad_request(message, param="clear_cache")
    state.check_accepting()
    await state.engine.pause_generation(mode=mode, clear_cache=raw.lower() in ("true", "1"))
    logger.info("generation paused (POST /pause, mode %s)", mode)
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    """Resume generation after ``/pause``."""
    state = request.app.state.chassis
    state.check_accepting()
    await state.engine.resume_generation()
    logger.info("generation resumed (POST /resume)")
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> JSONResponse:
    """``{"is_paused": bool}``."""
    state = request.app.state.chassis
    state.check_accepting()
    return JSONResponse({"is_paused": bool(await state.engine.is_paused())})


def _mode(request: Request) -> PauseMode:
    """The ``?mode=`` of ``/sleep`` and ``/pause`` (``abort`` when absent); a 400 naming
    ``mode`` for another value."""
    try:
        return check_pause_mode(request.query_params.get("mode", "abort"))
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="mode") from None
