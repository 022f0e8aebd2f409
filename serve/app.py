"""``build_app``: the FastAPI application of ``chassis serve`` around one engine.

Routes (every one answers errors in OpenAI's shape, see :mod:`chassis.serve.errors`):

=========================  ==================================================================
``GET  /v1/models``        the served model (each of its names), then its LoRA adapters
``GET  /v1/models/{model}``  one of those cards (OpenAI's retrieve), 404 for another name
``POST /v1/completions``   :mod:`chassis.serve.openai_completions`
``POST /v1/chat/completions``  :mod:`chassis.serve.openai_chat`
``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``, ``.../cancel``: :mod:`chassis.serve.openai_responses`
``POST /v1/embeddings``    :mod:`chassis.serve.openai_embeddings` (``--runner pooling``)
``POST /v1/audio/transcriptions``, ``/v1/audio/translations``: multipart forms,
                           :mod:`chassis.serve.openai_transcriptions` (Whisper)
``POST /score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``:
                           :mod:`chassis.serve.openai_score` (``--runner pooling``)
``POST /classify``, ``/pooling``: :mod:`chassis.serve.openai_classify` (pooling engines)
``POST /tokenize``         ``prompt`` or chat ``messages`` (images expanded) -> token ids
``POST /detokenize``       token ids -> text
``GET  /health``           200, or 503 when the engine is dead or the server shutting down
``GET``/``POST /ping``      the same as ``/health`` (SageMaker's probe)
``POST /invocations``      any of the APIs above, picked by the body's keys
                           (:mod:`chassis.serve.invocations`, SageMaker's route)
``GET  /load``             ``{"server_load": N}`` with ``--enable-server-load-tracking``
                           only (:mod:`chassis.serve.request_tracking`)
``GET  /metrics``          Prometheus text (:mod:`chassis.serve.metrics`)
``GET  /version``          ``{"version": chassis.__version__}``
``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``: with
                           ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` only
                           (:mod:`chassis.serve.lora_routes`)
``POST /reset_prefix_cache``, ``GET /server_info``, sleep mode's ``POST /sleep``,
                           ``POST /wake_up``, ``GET /is_sleeping``: with
                           ``$VLLM_SERVER_DEV_MODE`` only (:mod:`chassis.serve.dev_routes`)
plugins' routes            ``chassis_register_routes`` (:mod:`chassis.serve.plugin_routes`)
=========================  ==================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import chassis
from chassis.core.chat_media import ChatImages
from chassis.core.generation_defaults import generation_defaults
from chassis.core.media_options import media_loaders
from chassis.serve import errors
from chassis.serve.chat_parsing import ChatParsers
from chassis.serve.dev_routes import router as dev_router
from chassis.serve.errors import install_exception_handlers
from chassis.serve.invocations import router as invocations_router
from chassis.serve.lora_routes import router as lora_router
from chassis.serve.metrics import ServerMetrics
from chassis.serve.openai_chat import router as chat_router
from chassis.serve.openai_classify import router as classify_router
from chassis.serve.openai_completions import router as completions_router
from chassis.serve.openai_embeddings import router as embeddings_router
from chassis.serve.openai_responses import router as responses_router
from chassis.serve.openai_score import router as score_router
from chassis.serve.openai_transcriptions import router as transcriptions_router
from chassis.serve.plugin_routes import include_plugin_routes
from chassis.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from chassis.serve.renderer import ChatRenderer
from chassis.serve.request_tracking import (
    RequestIdHeaderMiddleware,
    ServerLoad,
    ServerLoadMiddleware,
    server_load,
)
from chassis.serve.responses_background import BackgroundResponses, background_responses
from chassis.serve.responses_store import ResponseStore, store_size_from_env
from chassis.serve.root_path import RootPathMiddleware
from chassis.serve.security import install_security
from chassis.serve.settings import ServerSettings
from chassis.serve.state import ServerState
from chassis.serve.user_middleware import add_user_middleware

logger = logging.getLogger(__name__)


def get_state(app: FastAPI) -> ServerState:
    """The :class:`ServerState` that :func:`build_app` attached to ``app``."""
    return app.state.chassis


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


def _model_cards(state: ServerState) -> list[ModelCard]:
    """The served model's cards (one per served name, the first first), then its LoRA
    adapters'."""
    # one card per served name (vLLM's several --served-model-name), the first first
    cards = [
        ModelCard(
            id=name,
            root=getattr(state.engine.config, "model", None),
            max_model_len=state.max_model_len,
        )
        for name in state.model_names
    ]
    # vLLM's adapter cards: root = the adapter's folder, parent = the base model
    cards += [
        ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=state.model_name,
            max_model_len=state.max_model_len,
        )
        for lora in state.loras
    ]
    return cards


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=_model_cards(_state(request))).model_dump(mode="json"))


async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """OpenAI's ``GET /v1/models/{model}``: the card of one served name or adapter, else the
    404 a request naming an unknown model gets."""
    state = _state(request)
    cards = {card.id: card for card in _model_cards(state)}
    if model not in cards:
        state.resolve_model(model)  # a name nothing serves: the 404 listing the served ones
    return JSONResponse(cards[model].model_dump(mode="json"))


async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """``prompt`` or ``messages`` as the token ids the engine would run. The messages'
    image parts are taken as on the chat route (the same loader, limits and 400s) and, as
    vLLM's ``/tokenize`` does, each image's placeholder is expanded to the image's tokens by
    the model's processor (``mm_processor_kwargs`` applied): ``count`` is the prompt length
    chat completions report for the same messages."""
    state = _state(request)
    state.check_model(body.model)
    body.check()
    renderer = state.renderer
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        ids = await asyncio.to_thread(
            renderer.tokenize, body.prompt, add_special_tokens=add_special
        )
    else:
        images: list[Any] = []
        ids = await asyncio.to_thread(
            renderer.render_ids,
            body.messages or [],
            add_generation_prompt=body.add_generation_prompt is not False,
            continue_final_message=bool(body.continue_final_message),
            tools=body.tools,
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
            add_special_tokens=bool(body.add_special_tokens),
            images=images,
        )
        if images:
            ids = await asyncio.to_thread(
                _with_images_expanded, renderer, ids, images, body.mm_processor_kwargs
            )
    token_strs = None
    if body.return_token_strs:
        token_strs = list(state.tokenizer.convert_ids_to_tokens(ids))
    response = TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=token_strs
    )
    return JSONResponse(response.model_dump(mode="json", exclude_none=True))


def _with_images_expanded(
    renderer: ChatRenderer, ids: list[int], images: list[Any], kwargs: dict[str, Any] | None
) -> list[int]:
    """``ids`` (one placeholder per image) with each image's placeholder expanded by the
    model's processor, as the engine's input processor expands them; a 400 for what the
    processor refuses (``mm_processor_kwargs``, an image it cannot take)."""
    assert renderer.chat_images is not None  # (images were taken: the renderer has them)
    try:
        expanded, _ = renderer.chat_images.multimodal.expand(ids, {"image": images}, kwargs)
    except ValueError as exc:
        raise errors.from_value_error(exc) from None  # (as the chat route's engine errors)
    return expanded


async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = _state(request)
    state.check_model(body.model)
    vocab_size = len(state.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise errors.bad_request(
            f"token ids out of the vocabulary [0, {vocab_size}): {bad[:10]}", "tokens"
        )
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))


async def health(request: Request) -> Response:
    state = _state(request)
    if state.shutting_down:
        return errors.shutting_down().response()
    try:
        await state.engine.check_health()
    except Exception as exc:
        return errors.to_api_error(exc).response()
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    content, content_type = _state(request).metrics.render()
    return Response(content=content, media_type=content_type)


async def version(request: Request) -> JSONResponse:
    return JSONResponse(VersionResponse(version=chassis.__version__).model_dump())


def _lenient_content_type() -> dict[str, Any]:
    """Read a body without a ``Content-Type`` as JSON, as FastAPI did before its
    ``strict_content_type`` (on by default in recent releases) and as vLLM's clients expect:
    ``requests.post(url, data=json.dumps(body))`` sends none. A body with a non-JSON content
    type is still not parsed (it gets a 400 that names the content type)."""
    if "strict_content_type" in inspect.signature(FastAPI).parameters:
        return {"strict_content_type": False}
    return {}


def _docs_urls(settings: ServerSettings) -> dict[str, Any]:
    """FastAPI's schema and docs pages (``/openapi.json``, ``/docs``, ``/redoc``, served by
    default as vLLM does), or none with ``--disable-fastapi-docs``."""
    if settings.disable_fastapi_docs:
        return {"openapi_url": None, "docs_url": None, "redoc_url": None}
    return {}


def _add_static_loras(state: ServerState) -> None:
    """Serve ``--lora-modules``, each checked against the model (``ValueError`` naming the
    adapter when one is refused)."""
    for module in state.settings.lora_modules:
        base = module.base_model_name
        if base is not None and base not in (
            *state.model_names,
            getattr(state.engine.config, "model", None),
        ):
            logger.warning(
                "--lora-modules %s: base_model_name %r is not the served model %r (ignored)",
                module.name,
                base,
                state.model_name,
            )
        lora = state.loras.add_module(module)
        logger.info("LoRA adapter %r (id %d): %s", lora.lora_name, lora.lora_int_id, lora.lora_path)


def _chat_images(engine: Any) -> ChatImages | None:
    """How chat requests' image parts reach ``engine``: its input processor's multimodal
    admission and an image loader with its settings; ``None`` (image parts refused as any
    part that is not text) for an engine without that input processor."""
    multimodal = getattr(getattr(engine, "input_processor", None), "multimodal", None)
    if multimodal is None:
        return None
    # (the folder, --allowed-media-domains and --media-io-kwargs: core/media_options.py)
    return ChatImages(multimodal, *media_loaders(engine.config))


def build_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (an ``AsyncLLM``; see :mod:`chassis.serve.state` for
    the part of its contract used) with ``settings`` (defaults: :class:`ServerSettings()`).

    The app's state is ``app.state.chassis`` (:class:`ServerState`). When the lifespan ends
    (uvicorn's shutdown, or a ``TestClient`` leaving its ``with`` block) the server stops
    accepting requests, aborts in-flight ones and, if ``settings.shutdown_engine_on_exit``,
    shuts the engine down. Raises ``ValueError`` for a bad ``--chat-template``, for
    unknown parser names, for a ``--generation-config`` that cannot be read and for a
    ``--lora-modules`` adapter the engine cannot run, for a plugin route that cannot be
    added (its path is taken; the message names the plugin), for a ``--middleware`` that
    cannot be imported or is neither a class nor an async function, for an invalid
    ``$CHASSIS_RESPONSES_STORE_SIZE`` or ``$CHASSIS_RESPONSES_EVENTS_PER_RESPONSE``, and
    for an ``--allowed-local-media-path`` that is no folder or an invalid
    ``$VLLM_IMAGE_FETCH_TIMEOUT``.
    """
    settings = settings or ServerSettings()
    state = ServerState(
        engine=engine,
        settings=settings,
        renderer=ChatRenderer(
            engine.tokenizer,
            getattr(engine.config, "chat_template", None),
            trust_request_chat_template=settings.trust_request_chat_template,
            chat_template_content_format=settings.chat_template_content_format,
            chat_images=_chat_images(engine),
        ),
        metrics=ServerMetrics.of_engine(engine),
        parsers=ChatParsers.from_settings(settings),
        sampling_defaults=generation_defaults(
            getattr(engine.config, "generation_config", "auto"),
            getattr(engine.config, "model", None),
            getattr(engine.config, "override_generation_config", None),
        ),
    )

    _add_static_loras(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.shutting_down = True
        await state.abort_all()
        # background responses end cancelled (their engine requests aborted just above)
        await background_responses(app).close()
        if settings.shutdown_engine_on_exit:
            try:
                await engine.shutdown()
            except Exception as exc:
                logger.warning("engine shutdown failed: %s", exc)

    app = FastAPI(
        title="chassis",
        version=chassis.__version__,
        description="OpenAI-compatible API of a chassis engine",
        lifespan=lifespan,
        **_docs_urls(settings),
        **_lenient_content_type(),
    )
    app.state.chassis = state
    # made now: a bad $CHASSIS_RESPONSES_STORE_SIZE or $CHASSIS_RESPONSES_EVENTS_PER_RESPONSE
    # stops start-up (on first use it would answer every /v1/responses request with a 400
    # blaming the client)
    app.state.responses_store = ResponseStore(store_size_from_env())
    app.state.responses_background = BackgroundResponses()
    install_exception_handlers(app)
    if settings.enable_server_load_tracking:  # inside the security checks: refused requests
        app.state.server_load = ServerLoad()  # are no load
        app.add_middleware(ServerLoadMiddleware, load=app.state.server_load)
        app.add_api_route("/load", server_load, methods=["GET"])
    install_security(app, settings)
    if settings.root_path:  # outer: the API-key check sees the prefix too
        app.add_middleware(RootPathMiddleware, root_path=settings.root_path)
    if settings.enable_request_id_headers:  # outermost: every response gets the header
        app.add_middleware(RequestIdHeaderMiddleware)
    add_user_middleware(app, settings.middleware)  # --middleware: outside all of ours

    app.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList)
    app.add_api_route(
        "/v1/models/{model:path}", retrieve_model, methods=["GET"], response_model=ModelCard
    )
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(responses_router)
    app.include_router(embeddings_router)
    app.include_router(score_router)
    app.include_router(classify_router)
    app.include_router(transcriptions_router)
    app.add_api_route("/tokenize", tokenize, methods=["POST"], response_model=TokenizeResponse)
    app.add_api_route(
        "/detokenize", detokenize, methods=["POST"], response_model=DetokenizeResponse
    )
    app.add_api_route("/health", health, methods=["GET"])
    for method in ("GET", "POST"):  # one route per method: one OpenAPI operation id each
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")
    app.include_router(invocations_router)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"], response_model=VersionResponse)
    if settings.allow_runtime_lora_updating:
        logger.warning(
            "LoRA adapters may be loaded and unloaded at run time "
            "(/v1/load_lora_adapter): any client with the API key can make the server read "
            "a folder of its choice; use this for local development only"
        )
        app.include_router(lora_router)
    if settings.server_dev_mode:
        logger.warning(
            "development routes are on (/reset_prefix_cache, /server_info, /sleep, "
            "/wake_up, /is_sleeping): any client with the API key can reset the engine's "
            "prefix cache, read its settings and put it to sleep; use this for local "
            "development only"
        )
        app.include_router(dev_router)
    # Last, so a plugin path that is already served is caught (an error naming the plugin).
    include_plugin_routes(app)
    return app
