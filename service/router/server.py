"""serve_router(settings, sock): run the router's app under uvicorn until SIGTERM/SIGINT, then exit 0.

Knows: uvicorn's graceful stop (open connections and streams get `shutdown_timeout_s` to finish),
then the app's lifespan stops the health loop and the subscribers. As service/server.py does for
a backend, the signal is not re-raised after the graceful stop: the process exits with status 0.
Connections are read under service/read_limits.py's deadlines, as a backend's are (`router_config`).
Doesn't know: the app's routes.
"""
from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from service.read_limits import ReadLimits, http_protocol
from service.router.app import create_router_app
from service.router.settings import RouterSettings


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recorded in uvicorn's _captured_signals, so run() returns instead of the
        # process dying of the re-raised signal. A second SIGINT skips the waiting.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def router_config(app: Any, settings: RouterSettings, **kw: Any) -> uvicorn.Config:
    """uvicorn's config for the router's app: our h11 protocol with the settings' read limits.
    uvicorn's access line is off unless asked for: the router's request log (request_log.py)
    writes one with more in it."""
    kw.setdefault("access_log", False)
    limits = ReadLimits(settings.header_timeout_s, settings.body_timeout_s, settings.max_body_bytes)
    return uvicorn.Config(app, http=http_protocol(limits), lifespan="on", **kw)


def serve_router(settings: RouterSettings, sock: socket.socket, log_level: str = "info",
                 shutdown_timeout_s: float = 30.0) -> None:
    config = router_config(create_router_app(settings), settings, log_level=log_level,
                           timeout_graceful_shutdown=shutdown_timeout_s)
    _Server(config).run(sockets=[sock])
