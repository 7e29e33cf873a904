"""Service test harness: a real uvicorn server on a free loopback port, in a thread or a process."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from service.app import create_app
from service.server import uvicorn_config
from service.settings import ServiceSettings
from tests.service.tiny_engine import build_engine, default_tokenizer_dir, load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> str:
    """The real SmolLM2 tokenizer's directory (converting the default model once if needed)."""
    path = default_tokenizer_dir()
    if path is None:
        request.getfixturevalue("default_model")      # runs the one-time conversion
        path = default_tokenizer_dir()
    assert path is not None
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


class ServerThread:
    """create_app(engine, settings) under uvicorn in a background thread, on 127.0.0.1:<free port>."""

    def __init__(self, engine, settings: ServiceSettings = ServiceSettings()) -> None:
        self.engine = engine
        self.app = create_app(engine, settings)
        # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto
        # says TCP, and with Nagle on, a response written in two parts (headers, then body) waits
        # for the client's delayed ACK: 40 ms a request. `tieredkv serve`'s socket (getaddrinfo's,
        # tieredkv/cli_serve.bind_socket) never paid it; this harness did, on every request.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # serve()'s config: its h11 protocol with the read limits (service/read_limits.py).
        self.server = uvicorn.Server(uvicorn_config(self.app, settings, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "server did not stop"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    eng = build_engine(tmp_path_factory.mktemp("cache"), tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    """A no-keys server (every caller an admin, tenant from `user`); it closes the engine on stop."""
    with ServerThread(engine) as s:
        yield s


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


class ServerProcess:
    """tests/service/server_main.py in a subprocess: for kill -9 and signal tests."""

    def __init__(self, cache_dir: Path, tokenizer_dir: str, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(REPO / "tests" / "service" / "server_main.py"),
             "--cache-dir", str(cache_dir), "--tokenizer-dir", tokenizer_dir, *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("LISTENING "), f"server did not start: {line!r}"
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        with httpx.Client(base_url=self.url, timeout=60) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and self.proc.poll() is None, "server never became healthy"
                time.sleep(0.05)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def write_keys(path: Path, keys: dict) -> str:
    path.write_text(json.dumps(keys))
    return str(path)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, parsed; the final `[DONE]` kept as the string."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def check_usage(u: dict) -> None:
    """Every usage object: all fields present and consistent; hit + miss == prompt."""
    tiers = u["prompt_cache_hit_tokens_by_tier"]
    assert set(tiers) == {"device", "host", "disk", "remote"}
    assert sum(tiers.values()) == u["prompt_cache_hit_tokens"] == u["prompt_tokens_details"]["cached_tokens"]
    assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
