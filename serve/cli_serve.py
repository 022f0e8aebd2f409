"""``chassis serve [MODEL]``: start the OpenAI-compatible HTTP server (see docs/serving.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from chassis.core.chat_content_format import CONTENT_FORMAT_OPTIONS
from chassis.serve.args import add_engine_args, engine_config_from_args, parse_memory_size
from chassis.serve.lora import check_lora_modules, parse_lora_modules
from chassis.serve.responses_events import events_per_response_from_env
from chassis.serve.responses_store import store_size_from_env
from chassis.serve.settings import (
    DEFAULT_HOST,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerSettings,
)
from chassis.serve.tls import check_tls
from chassis.serve.user_middleware import import_middleware

if TYPE_CHECKING:
    import socket

    from chassis.core.config import EngineConfig

logger = logging.getLogger("chassis.serve")

API_KEY_ENV = "CHASSIS_API_KEY"
#: vLLM's variable for the key, read when neither --api-key nor $CHASSIS_API_KEY is set
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def _builtin_parser_names(hook: str) -> str:
    """The names the built-in parsers plugin registers through ``hook``, sorted and
    comma-separated, for the help text. Read from the built-in module alone, loading no
    plugin, so that a broken plugin does not break ``--help``."""
    from chassis.builtin_plugins import parsers
    from chassis.plugins.registry import Registry

    registry: Registry[Any] = Registry("parser")
    getattr(parsers, hook)(registry=registry)
    return ", ".join(registry.names())


def _string_list(text: str) -> list[str]:
    """A JSON list (``'["a","b"]'``, vLLM's form) or comma-separated values."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON list {text!r}: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _LoRAModulesAction(argparse.Action):
    """``--lora-modules ITEM [ITEM ...]``: each item parsed (:func:`parse_lora_modules`);
    the flag may be repeated, its adapters add up."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        modules = list(getattr(namespace, self.dest, None) or [])
        for item in values:
            if not item.strip():
                continue  # vLLM skips empty items
            try:
                modules += parse_lora_modules(item)
            except ValueError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, modules)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (the engine's come from :func:`add_engine_args`)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default: {DEFAULT_HOST}, this machine only; "
        "use 0.0.0.0 to listen on every interface)",
    )
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default: {DEFAULT_PORT})")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV}, else vLLM's ${VLLM_API_KEY_ENV}, else no authentication)",
    )
    g.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="serve /metrics without the API key (for scrapers that cannot send one)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=[],
        help="CORS origins, comma-separated or a JSON list (default: none, CORS off)",
    )
    g.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        help="CORS methods (default: *)",
    )
    g.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        help="CORS request headers (default: *)",
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument(
        "--max-request-body-size",
        type=_size,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="largest request body, e.g. 8MiB (default: 8MiB); larger gets 413",
    )
    g.add_argument(
        "--max-header-size",
        type=_size,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="largest request line plus headers (default: 64KiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help=f"seconds to wait for in-flight responses on SIGTERM "
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="idle keep-alive seconds (default: 5)"
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: info)",
    )
    g.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",
        dest="disable_access_log",
        action="store_true",
        help="do not log one line per request (--disable-uvicorn-access-log is vLLM's name)",
    )
    g.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain)")
    g.add_argument(
        "--ssl-keyfile", help="the certificate's PEM private key (if not in --ssl-certfile)"
    )
    g.add_argument(
        "--ssl-keyfile-password",
        help="the password of an encrypted private key (visible to other users in the process "
        "list, as uvicorn's and vLLM's flag of the same name)",
    )
    g.add_argument(
        "--ssl-ca-certs", help="PEM CA certificates that client certificates are checked against"
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="client certificates: 0 not asked (default), 1 optional, 2 required",
    )
    g.add_argument(
        "--uds",
        metavar="PATH",
        help="listen on this Unix domain socket instead of --host/--port",
    )
    g.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a reverse proxy serves this server under, e.g. /llm: routes "
        "answer with and without it, the OpenAPI schema and /docs name it (default: none)",
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs, /redoc nor /openapi.json",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob entries name their token 'token_id:ID' instead of its text (for tokens "
        "that are no valid UTF-8 alone); a request's return_tokens_as_token_ids wins",
    )
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log one line per generation request: its id, prompt, sampling params and LoRA "
        "adapter (default: off)",
    )
    g.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_const",
        const=False,
        help="vLLM's older flag; the default (same as --no-enable-log-requests)",
    )
    g.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests: also log each completion's text, token ids and "
        "finish reason once it ends",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        metavar="N",
        help="with --enable-log-requests: log at most N characters of a prompt and N of its "
        "token ids (default: all)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="usage.prompt_tokens_details.cached_tokens (prefix-cache hits) in completions "
        "and chat (default: on, unlike vLLM; --no-enable-prompt-tokens-details sends null)",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role of chat responses' messages when the prompt ends with the generation "
        "prompt (default: assistant; otherwise the last message's role, as vLLM)",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer every request with an X-Request-Id header: the request's own X-Request-Id, "
        "or a new id",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count the API requests being served (generation, pooling, /invocations) and "
        'report the count at GET /load as {"server_load": N}',
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streamed completions and chat completions end with the usage chunk even when "
        "the request did not ask (stream_options.include_usage)",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="a chat request with tool_choice 'none' is rendered without its tools (by "
        "default the chat template still sees them)",
    )
    g.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="IMPORT_PATH",
        help="an extra ASGI middleware, 'package.module.Name' (or 'package.module:Name'): a "
        "class is added with app.add_middleware, an async function (request, call_next) "
        "as an HTTP middleware; repeat the flag for several (the last is outermost)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat template (chat_template, or chat_template in "
        "chat_template_kwargs) instead of the server's; without it such a request is a 400 "
        "(a template is code the server runs: trust your clients first)",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMAT_OPTIONS,
        default="auto",
        help="how message content reaches the chat template: 'string' = the text parts "
        "joined to one string, 'openai' = a list of {type: text, text} parts, 'auto' = "
        "detected from the template (a loop over a message's content: openai)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action=_LoRAModulesAction,
        default=[],
        metavar="ADAPTER",
        help="LoRA adapters to serve (needs --enable-lora), each 'name=path' or vLLM's JSON "
        '\'{"name": "...", "path": "...", "base_model_name": "..."}\'; a request selects one '
        "by sending its name as 'model' (see docs/lora.md)",
    )
    g = parser.add_argument_group("chat output parsing (see docs/serving.md)")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="return the tool calls a model writes as OpenAI tool_calls (needs --tool-call-parser)",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="the model's tool-call format: "
        + _builtin_parser_names("chassis_register_tool_parsers")
        + ", or a plugin's (chassis plugins lists them)",
    )
    g.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="split the model's reasoning into the message's 'reasoning' field: "
        + _builtin_parser_names("chassis_register_reasoning_parsers")
        + ", or a plugin's",
    )


def add_parser(subparsers: Any) -> None:
    """Register the ``serve`` sub-command."""
    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible API server",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, ...). See docs/serving.md.",
    )
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """:class:`ServerSettings` from the parsed flags (``$CHASSIS_API_KEY``, else
    ``$VLLM_API_KEY``, when no --api-key)."""
    api_key = args.api_key
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_key=api_key,
        metrics_require_auth=not args.allow_unauthenticated_metrics,
        allowed_origins=list(args.allowed_origins),
        allowed_methods=list(args.allowed_methods),
        allowed_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_size,
        max_header_bytes=args.max_header_size,
        shutdown_timeout_s=args.shutdown_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora_modules=list(args.lora_modules),
        served_model_aliases=list((args.served_model_name or [])[1:]),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_keyfile_password=args.ssl_keyfile_password,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        uds=args.uds,
        root_path=args.root_path,
        disable_fastapi_docs=args.disable_fastapi_docs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_log_requests=args.enable_log_requests,
        enable_log_outputs=args.enable_log_outputs,
        max_log_len=args.max_log_len,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        response_role=args.response_role,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_force_include_usage=args.enable_force_include_usage,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        middleware=list(args.middleware),
    )


def run(args: argparse.Namespace) -> int:
    """Bind the port, build the engine and the app, serve until SIGTERM/SIGINT or engine
    death.

    Returns 0 after a clean shutdown (uvicorn then re-raises a SIGTERM, so the process ends
    by that signal), 130 after Ctrl-C, 1 when the engine died or failed to start, 2 for
    invalid settings (the port included).
    """
    from chassis.core.config import DEFAULT_MODEL
    from chassis.serve.chat_parsing import ChatParsers

    try:
        settings = settings_from_args(args)
        config = engine_config_from_args(args)
        ChatParsers.from_settings(settings)  # unknown parser names fail before the model loads
        check_tls(settings)  # and so do unreadable certificates
        for path in settings.middleware:  # and --middleware that cannot be used
            import_middleware(path)
        store_size_from_env()  # and a bad $CHASSIS_RESPONSES_STORE_SIZE
        events_per_response_from_env()  # or $CHASSIS_RESPONSES_EVENTS_PER_RESPONSE
        check_lora_modules(
            settings.lora_modules,
            enable_lora=config.enable_lora,
            served_model_name=config.served_model_name or config.model or DEFAULT_MODEL,
            aliases=settings.served_model_aliases,
        )
    except (ValueError, ImportError) as exc:  # ImportError: a parser plugin that does not load
        logger.error("%s", exc)
        return 2
    if settings.enable_log_outputs and not settings.enable_log_requests:
        logger.warning("--enable-log-outputs has no effect without --enable-log-requests")
    if settings.tool_call_parser and not settings.enable_auto_tool_choice:
        logger.warning(
            "--tool-call-parser %s has no effect without --enable-auto-tool-choice",
            settings.tool_call_parser,
        )

    from chassis.serve.server import bind_sockets, bind_unix_socket, listen_address

    # Take the port first: a port in use fails now, not after loading the model.
    try:
        if settings.uds is not None:
            sockets = [bind_unix_socket(settings.uds)]
        else:
            sockets = bind_sockets(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s: %s", listen_address(settings), exc)
        return 2
    if settings.uds is None:
        settings.port = sockets[0].getsockname()[1]  # the real one when --port 0
    try:
        return _serve(config, settings, sockets)
    finally:
        for sock in sockets:
            sock.close()
        if settings.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(settings.uds)


def _serve(config: EngineConfig, settings: ServerSettings, sockets: list[socket.socket]) -> int:
    """Start the engine, then serve on ``sockets`` until the end; the exit status of
    :func:`run`."""
    from chassis.core.async_llm import AsyncLLM
    from chassis.core.errors import EngineDeadError
    from chassis.core.heap import freeze_startup_heap
    from chassis.serve.app import build_app
    from chassis.serve.server import listen_address, run_server

    if settings.api_key is None:
        logger.warning(
            "no API key set (--api-key, $%s or $%s): any client that can reach %s may use it",
            API_KEY_ENV,
            VLLM_API_KEY_ENV,
            listen_address(settings),
        )
    try:
        engine = AsyncLLM.from_engine_config(config)
    except ValueError as exc:  # PluginLoadError and PluginObjectError: main() reports, exit 1
        logger.error("cannot start the engine: %s", exc)
        return 2
    except EngineDeadError as exc:  # the engine core's own log above has the traceback
        logger.debug("engine start-up failed", exc_info=True)
        logger.error("cannot start the engine: %s", exc)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    try:
        app = build_app(engine, settings)
        freeze_startup_heap()  # this process serves one app until it exits
        return run_server(app, settings, sockets)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    finally:
        # The app's lifespan shuts the engine down on a normal exit; this covers start-up
        # failures and forced exits. Shutdown is idempotent.
        try:
            engine.shutdown_sync()
        except Exception as exc:
            logger.debug("engine shutdown: %s", exc)
