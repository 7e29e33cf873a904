"""The router under uvicorn in a thread, in front of real tiny-engine servers, for the router's tests."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from service.router.app import create_router_app
from service.router.server import router_config
from service.router.settings import RouterSettings
from storage.config import CacheConfig
from tests.kv_event_keys import client_secret_file, events_options

MODEL = "random:llama:seed0"       # what tests/service/tiny_engine.build_engine serves


def events_kw() -> dict:
    """CacheConfig options that turn KV events on (a free loopback port, the test router's CURVE
    key allowed: tests/kv_event_keys.py), where this tree has them."""
    return events_options() if "kv_events" in CacheConfig.__dataclass_fields__ else {}


class RouterThread:
    def __init__(self, *backends: str, **kw) -> None:
        # IPPROTO_TCP: so asyncio turns Nagle off (a 40 ms wait per response otherwise; see
        # tests/service/conftest.py's ServerThread).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        # The router's CURVE key is the one the backends allow (events_kw), unless a test says otherwise.
        kw = {"health_interval_s": 0.5, "kv_events_key": client_secret_file(), **kw}
        settings = RouterSettings(backends=tuple(backends), **kw)
        self.app = create_router_app(settings)
        self.server = uvicorn.Server(router_config(self.app, settings, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def router(self):
        return self.app.state.router

    def __enter__(self) -> "RouterThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "router did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "router did not stop"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def health(self) -> dict:
        with self.client() as c:
            return c.get("/health").json()

    def backend_view(self, url: str) -> dict:
        return next(b for b in self.health()["backends"] if b["url"] == url)


def complete(client: httpx.Client, prompt: str, user: str = "acme", **kw) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                "temperature": 0, "user": user, **kw})


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.05)
