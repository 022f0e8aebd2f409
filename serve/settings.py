"""``ServerSettings``: how the HTTP server behaves (not the engine: that is ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chassis.core.chat_content_format import check_content_format
from chassis.serve.dev_routes import server_dev_mode_enabled
from chassis.serve.lora import LoRAModule, runtime_lora_updating_allowed

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: Largest request body accepted (413 beyond); chat histories of a 128k-token context fit.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
#: Largest request line plus headers (uvicorn's h11 ``max_incomplete_event_size``).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
#: Seconds in-flight requests get to finish after SIGTERM (they are aborted first, so they
#: finish at once; this bounds a stuck one).
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class ServerSettings:
    """Settings of the API server, from ``chassis serve`` flags or set by tests and embedders.

    ``api_key`` ``None`` disables authentication. ``allowed_origins`` empty disables CORS.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    #: require the API key on ``/metrics`` too (``/health`` never needs it)
    metrics_require_auth: bool = True
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    timeout_keep_alive_s: int = 5
    uvicorn_log_level: str = "info"
    access_log: bool = True
    #: call ``engine.shutdown()`` when the app's lifespan ends
    shutdown_engine_on_exit: bool = True
    #: parse tool calls out of chat outputs (needs ``tool_call_parser``)
    enable_auto_tool_choice: bool = False
    #: tool-call parser name (``chassis_register_tool_parsers``), e.g. ``"hermes"``
    tool_call_parser: str | None = None
    #: reasoning parser name (``chassis_register_reasoning_parsers``), e.g. ``"qwen3"``
    reasoning_parser: str | None = None
    #: LoRA adapters served from the start (``--lora-modules``; the engine needs
    #: ``enable_lora``); their ids are 1, 2, ... in this order
    lora_modules: list[LoRAModule] = field(default_factory=list)
    #: further names requests may send as ``model`` for the served model (the names after
    #: the first of ``--served-model-name``, as in vLLM); answers, /metrics and LoRA
    #: adapters' ``parent`` carry the first (the engine's ``model_name``)
    served_model_aliases: list[str] = field(default_factory=list)
    #: serve HTTPS with this PEM certificate chain and private key (``--ssl-certfile``,
    #: ``--ssl-keyfile``; the key may be in the certificate file); ``None``: plain HTTP
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: the password of an encrypted private key (``--ssl-keyfile-password``); ``None``: the
    #: key is not encrypted (an encrypted one is then refused at start-up, never prompted for)
    ssl_keyfile_password: str | None = field(default=None, repr=False)
    #: PEM CA certificates that client certificates are verified against (``--ssl-ca-certs``)
    ssl_ca_certs: str | None = None
    #: whether clients present a certificate (``--ssl-cert-reqs``, :mod:`ssl`'s values):
    #: 0 ``CERT_NONE`` (default), 1 ``CERT_OPTIONAL``, 2 ``CERT_REQUIRED``
    ssl_cert_reqs: int = 0
    #: listen on this Unix domain socket instead of ``host:port`` (``--uds``)
    uds: str | None = None
    #: add ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (default: from
    #: ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or ``$CHASSIS_ALLOW_RUNTIME_LORA_UPDATING``)
    allow_runtime_lora_updating: bool = field(default_factory=runtime_lora_updating_allowed)
    #: add the development routes of :mod:`chassis.serve.dev_routes` (``POST
    #: /reset_prefix_cache``; default: from ``$VLLM_SERVER_DEV_MODE`` or
    #: ``$CHASSIS_SERVER_DEV_MODE``)
    server_dev_mode: bool = field(default_factory=server_dev_mode_enabled)
    #: the role of chat responses' messages when the prompt ends with the generation prompt
    #: (``--response-role``, vLLM's flag)
    response_role: str = "assistant"
    #: answer every request with an ``X-Request-Id`` header: the request's own, or a new
    #: id (``--enable-request-id-headers``, vLLM's flag)
    enable_request_id_headers: bool = False
    #: count the API requests being served and report the count at ``GET /load``
    #: (``--enable-server-load-tracking``, vLLM's flag)
    enable_server_load_tracking: bool = False
    #: streams end with their usage chunk even when the request did not ask
    #: (``--enable-force-include-usage``, vLLM's flag)
    enable_force_include_usage: bool = False
    #: a chat request with ``tool_choice: "none"`` renders without its tools
    #: (``--exclude-tools-when-tool-choice-none``, vLLM's flag)
    exclude_tools_when_tool_choice_none: bool = False
    #: with ``enable_log_requests``: also log each completion once it ends
    #: (``--enable-log-outputs``, vLLM's flag)
    enable_log_outputs: bool = False
    #: extra ASGI middleware, import paths (``--middleware``, vLLM's flag): a class is added
    #: with ``app.add_middleware``, an async function as an ``http`` middleware
    middleware: list[str] = field(default_factory=list)
    #: the path prefix a reverse proxy serves the app under (``--root-path``, ASGI's
    #: ``root_path``): routes answer with and without it, the OpenAPI schema and the docs
    #: pages name it; "" = none
    root_path: str = ""
    #: serve no ``/docs``, ``/redoc`` nor ``/openapi.json`` (``--disable-fastapi-docs``)
    disable_fastapi_docs: bool = False
    #: logprob entries name their token ``"token_id:ID"`` instead of its text
    #: (``--return-tokens-as-token-ids``; a request's ``return_tokens_as_token_ids`` wins)
    return_tokens_as_token_ids: bool = False
    #: log one INFO line per generation request: id, prompt, sampling params, LoRA adapter
    #: (``--enable-log-requests``, :mod:`chassis.serve.request_log`)
    enable_log_requests: bool = False
    #: the logged prompt's most characters and most token ids (``--max-log-len``); None: all
    max_log_len: int | None = None
    #: usage carries ``prompt_tokens_details.cached_tokens`` (prefix-cache hits) in
    #: completions and chat (``--[no-]enable-prompt-tokens-details``; on by default, unlike
    #: vLLM: OpenAI always sends it)
    enable_prompt_tokens_details: bool = True
    #: a request may bring its own chat template (``chat_template``, or ``chat_template`` in
    #: ``chat_template_kwargs``), which then replaces the server's (vLLM's
    #: ``--trust-request-chat-template``); off: such a request is a 400
    trust_request_chat_template: bool = False
    #: the shape of messages' content in the chat template (vLLM's
    #: ``--chat-template-content-format``): "string" (joined text), "openai" (a list of text
    #: parts) or "auto" (detected per template, :mod:`chassis.core.chat_content_format`)
    chat_template_content_format: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid setting."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535]; got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty (omit it to disable authentication)")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"--max-request-body-size must be at least 1 KiB; got {self.max_request_body_bytes}"
            )
        if self.max_header_bytes < 1024:
            raise ValueError(
                f"--max-header-size must be at least 1 KiB; got {self.max_header_bytes}"
            )
        if self.timeout_keep_alive_s < 0:
            raise ValueError(f"--timeout-keep-alive must be >= 0; got {self.timeout_keep_alive_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0; got {self.shutdown_timeout_s}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate it signs)")
        if self.ssl_keyfile_password is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile-password needs --ssl-certfile (HTTPS)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(
                f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required); "
                f"got {self.ssl_cert_reqs}"
            )
        if self.ssl_certfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (HTTPS)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError(
                "--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs to verify "
                "them against"
            )
        if self.uds is not None and not self.uds:
            raise ValueError("--uds must be a socket path")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"--root-path must start with '/' and not end with one (e.g. /llm); "
                f"got {self.root_path!r}"
            )
        check_content_format(self.chat_template_content_format, "--chat-template-content-format")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0; got {self.max_log_len}")
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_aliases):
            raise ValueError("--served-model-name: a name must not be empty")
        names = [module.name for module in self.lora_modules]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"--lora-modules names each adapter once; repeated: {', '.join(repeated)}"
            )
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "--allow-credentials cannot be combined with --allowed-origins '*'; "
                "list the origins explicitly"
            )
