"""serve(engine, settings, host, port): run the app under uvicorn until SIGTERM/SIGINT, then exit cleanly.

Knows: the rules for binding (no API keys -> loopback only, refused otherwise), and the
shutdown sequence around uvicorn's: on the first signal the app stops admitting generation
requests (503) at once, uvicorn stops accepting connections and waits for the open ones
(bounded by settings.shutdown_timeout_s), then the app's lifespan waits for requests still
running in the engine and closes the engine (cached blocks flushed to disk). A second SIGINT
skips the waiting; the engine is still closed. serve() then returns normally (exit status 0):
uvicorn's habit of re-raising the signal after a graceful stop is not wanted here.
Every connection is read under service/read_limits.py's deadlines (`uvicorn_config`, which the
tests' servers use too). Each request is one line of the `tieredkv.requests` logger (service.request_log), so uvicorn's
access log is off unless asked for; the engine's close logs how many blocks it flushed.
Doesn't know: how the engine is built (the CLI and the tests do that).
"""
from __future__ import annotations

import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from service.app import closed_line, create_app
from service.context import AppContext
from service.read_limits import ReadLimits, http_protocol
from service.settings import ServiceSettings, is_loopback

log = logging.getLogger("tieredkv.service")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, context: AppContext) -> None:
        super().__init__(config)
        self._context = context

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recorded in uvicorn's _captured_signals, so run() returns instead of the
        # process dying of the re-raised signal; stop admitting before uvicorn even notices.
        self._context.dispatcher.start_draining()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def check_bind(host: str, settings: ServiceSettings) -> None:
    if settings.api_keys_file is None and not settings.api_keys and not is_loopback(host):
        raise ValueError(f"host: refusing to serve on {host!r} without API keys: anyone who can reach it would be an "
                         "admin of every tenant. Pass an API keys file (--api-keys) or a key (--api-key), or bind 127.0.0.1")


def uvicorn_config(app: Any, settings: ServiceSettings, **kw: Any) -> uvicorn.Config:
    """uvicorn's config for the app: our h11 protocol with the settings' read limits."""
    limits = ReadLimits(settings.header_timeout_s, settings.body_timeout_s, settings.max_body_bytes)
    return uvicorn.Config(app, http=http_protocol(limits), lifespan="on", **kw)


def serve(engine: Any, settings: ServiceSettings = ServiceSettings(), host: str | None = None,
          port: int | None = None, *, sock: socket.socket | None = None, log_level: str = "info",
          access_log: bool = False) -> None:
    """Serve until SIGTERM/SIGINT. `sock`: an already-bound listening socket (its address wins
    over host/port; a caller binds port 0 and reads the port back). Returns after the engine is closed.
    access_log: uvicorn's own line per request too (off: `tieredkv.requests` logs one with more in it)."""
    host = settings.host if host is None else host
    port = settings.port if port is None else port
    if sock is not None:
        host = sock.getsockname()[0]
    check_bind(host, settings)
    app = create_app(engine, settings)
    context: AppContext = app.state.tieredkv
    config = uvicorn_config(app, settings, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s)
    server = _Server(config, context)
    server.run(sockets=[sock] if sock is not None else None)
    if not context.engine_closed and settings.close_engine_on_shutdown:
        # A forced exit (second SIGINT) skips the lifespan and its waiting; the engine is
        # closed all the same, so cached blocks still reach the disk.
        context.engine_closed = True
        log.info("%s", closed_line(engine.close()))
    context.dispatcher.shutdown()
