"""Running the app under uvicorn: start-up, signals, engine death, graceful shutdown.

* HTTP/1.1 through uvicorn's httptools implementation, with a bound on unfinished request
  heads (``--max-header-size``) that httptools lacks (:mod:`chassis.serve.http_protocol`);
  h11 with its own bound when httptools is not installed.
* The event loop is uvloop's when it is installed (asyncio's otherwise).
* SIGTERM / SIGINT: uvicorn stops accepting connections; we also mark the server as
  shutting down (new requests and ``/health`` get 503) and abort every in-flight request, so
  open streams end at once with ``finish_reason: "abort"``; uvicorn then waits up to
  ``--shutdown-timeout`` seconds for responses to finish, runs the app's lifespan shutdown
  (which shuts the engine down), and exits.
* Engine death: the engine's dead callback sets ``should_exit``; in-flight requests fail with
  503 (or an error event in their stream), and the process exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from chassis.serve.http_protocol import http_config

if TYPE_CHECKING:
    from fastapi import FastAPI

    from chassis.serve.settings import ServerSettings
    from chassis.serve.state import ServerState

logger = logging.getLogger("chassis.serve")


def format_url(host: str, port: int, scheme: str = "http") -> str:
    """``scheme://host:port`` with IPv6 hosts bracketed."""
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def listen_address(settings: ServerSettings, port: int | None = None) -> str:
    """Where the server listens, as logged: ``unix:PATH`` with ``--uds``, else
    ``http(s)://host:port`` (``port`` overrides ``settings.port``, e.g. the one bound)."""
    if settings.uds is not None:
        return f"unix:{settings.uds}"
    scheme = "https" if settings.ssl_certfile is not None else "http"
    return format_url(settings.host, settings.port if port is None else port, scheme)


class ChassisServer(uvicorn.Server):
    """A uvicorn server that aborts in-flight requests on a signal and logs when it is ready."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, settings: ServerSettings
    ) -> None:
        super().__init__(config)
        self.state = state
        self.settings = settings
        self.engine_died = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_task: asyncio.Task[None] | None = None

    @property
    def bound_port(self) -> int | None:
        """The port actually listened on (useful with ``--port 0``)."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    return sock.getsockname()[1]
        return None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            port = self.bound_port or self.config.port
            logger.info("ready on %s", listen_address(self.settings, port))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets=sockets)
        # Here, not after serve(): uvicorn re-raises the signal that stopped it as serve()
        # returns, which ends the process before its callers' cleanup.
        if self.settings.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.settings.uds)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.shutting_down:
            logger.info("received %s: shutting down", signal.Signals(sig).name)
            self.begin_shutdown()
        super().handle_exit(sig, frame)

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort in-flight ones (safe to call from a signal handler)."""
        self.state.shutting_down = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def start_aborting() -> None:
            # keep a reference: the loop holds tasks only weakly
            self._abort_task = loop.create_task(self.state.abort_all())

        loop.call_soon_threadsafe(start_aborting)

    def on_engine_dead(self) -> None:
        """The engine's dead callback: stop serving (runs on the event loop)."""
        error = getattr(self.state.engine, "dead_error", None)
        logger.error("the engine core died (%s); shutting the server down", error)
        self.engine_died = True
        self.should_exit = True


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    """The uvicorn configuration ``settings`` ask for."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws="none",
        lifespan="on",
        timeout_keep_alive=settings.timeout_keep_alive_s,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        log_level=settings.uvicorn_log_level,
        access_log=settings.access_log,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_keyfile_password=settings.ssl_keyfile_password,
        ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs,
        # the CLI has configured logging already; keep uvicorn from replacing it
        log_config=None,
        **http_config(settings.max_header_bytes),
    )


#: listen backlog, uvicorn's default
BACKLOG = 2048


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets for ``host:port``, as asyncio's ``create_server`` (what uvicorn
    used before) makes them: one per address ``host`` resolves to (``localhost``: 127.0.0.1
    and ::1; ``""``: every interface), IPv6 ones IPv6-only, port 0 one free port for all.

    ``chassis serve`` binds before it loads the model, so a port in use (by another server,
    or by a second ``chassis serve`` still loading) fails in a second, not after a start-up
    of minutes; connections made during the load wait in the backlog.

    :raises OSError: an address cannot be bound (in use, not local, unknown host).
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the first socket got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix domain socket at ``path`` (``--uds``), with the permissions the
    process umask gives (uvicorn's own ``--uds`` opens it to every local user; here only
    who may write the file may connect). A socket file no server answers on (left by a
    killed server) is replaced.

    :raises OSError: a server answers on ``path``, or it is another kind of file, or the
        directory cannot be written.
    """
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # stale: its server is gone
            else:
                raise OSError(errno.EADDRINUSE, f"a server is listening on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_app(
    app: FastAPI, settings: ServerSettings, sockets: list[socket.socket] | None = None
) -> int:
    """Serve ``app`` (from :func:`~chassis.serve.app.build_app`) until a signal or engine
    death, on ``sockets`` (from :func:`bind_sockets`) or else on sockets bound now; return
    the exit status (0, or 1 when the engine died)."""
    state: ServerState = app.state.chassis
    server = ChassisServer(uvicorn_config(app, settings), state, settings)
    state.engine.add_dead_callback(server.on_engine_dead)
    await server.serve(sockets=sockets)
    return 1 if server.engine_died or state.engine.errored else 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (less CPU per streamed chunk), else None
    (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_server(
    app: FastAPI, settings: ServerSettings, sockets: list[socket.socket] | None = None
) -> int:
    """Blocking :func:`serve_app`; Ctrl-C returns 130 instead of a traceback."""
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve_app(app, settings, sockets))
    except KeyboardInterrupt:
        return 130
