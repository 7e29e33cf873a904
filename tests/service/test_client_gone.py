"""Issue 41, items 2 and 3: a client that goes away is a client's event. Whether it leaves before
its body was read, while its request waits (queued, or generating a non-streamed answer) or
mid-stream, and on whichever route: one INFO line (499 when no response had begun), a count in
`tieredkv_client_disconnects_total{phase}`, never a 500, never a traceback, and its request
aborted as before (tests/service/test_client_disconnect.py checks the bills).

A real server on loopback with the tiny engine; the clients are raw sockets that send headers
and half a body and close, as a flood of slow clients does, or httpx closing a stream.
"""
from __future__ import annotations

import json
import logging
import re
import socket

import httpx
import pytest

from engine.engine import Engine
from engine.model import model_from_config
from service.settings import ServiceSettings
from storage.config import CacheConfig
from tests.service.conftest import ServerThread
from tests.service.test_client_disconnect import idle, pages_held, wait_for
from tests.service.tiny_engine import BLOCK_SIZE, tiny_config

LONG = 900
# Every route that reads a body, with a body it would accept.
BODY_ROUTES = {"/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 2},
               "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
               "/tokenize": {"prompt": "hello"}, "/detokenize": {"tokens": [1, 2]},
               "/v1/cache/lookup": {"prompt": "hello"}, "/v1/cache/block_hashes": {"prompt": "hello"},
               "/v1/cache/flush": {}}
GET_ROUTES = ("/v1/models", "/v1/cache/status", "/v1/cache/tree", "/v1/cache/billing", "/health", "/ready",
              "/metrics", "/version", "/openapi.json", "/dashboard")


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{sel}}} (\S+)$" if sel else rf"^{name} (\S+)$", c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def server_errors(c: httpx.Client) -> float:
    return sum(float(v) for v in re.findall(r'^tieredkv_http_requests_total{[^}]*status="5\d\d"[^}]*} (\S+)$',
                                            c.get("/metrics").text, re.M))


def half_body(port: int, path: str, body: dict, headers: bytes = b"") -> None:
    """Headers and half of the body, then the connection closed."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
                     % (path.encode(), len(payload), headers, payload[:len(payload) // 2]))


def lines(caplog, path: str, status: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tieredkv.requests" and r.request_fields["path"] == path
            and r.request_fields["status"] == status]


def no_server_error_logged(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.name, r.getMessage()) for r in bad]


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO)        # every logger: uvicorn's "Exception in ASGI application" too
    return caplog


def test_a_client_gone_before_its_body_was_read_is_one_info_line_on_every_route(engine, logs) -> None:
    """Issue 41: `POST /v1/completions 500 ... reason="internal server error"` and a ClientDisconnect
    traceback, per client."""
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        before, errors = metric(c, "tieredkv_client_disconnects_total", phase="body"), server_errors(c)
        for path, body in BODY_ROUTES.items():
            half_body(s.port, path, {**body, "model": engine.model_name} if "model" in body else body)
        for path in GET_ROUTES:       # no body: the route answers a client that is gone (uvicorn drops it)
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode())
        wait_for(lambda: all(lines(logs, p, 499) for p in BODY_ROUTES))
        for path in BODY_ROUTES:
            (line,) = lines(logs, path, 499)
            assert line.levelno == logging.INFO
            assert line.request_fields["reason"] == "the client disconnected before its body was read"
        assert metric(c, "tieredkv_client_disconnects_total", phase="body") == before + len(BODY_ROUTES)
        for _ in range(20):           # a flood of them, as in the issue
            half_body(s.port, "/v1/completions", {"model": engine.model_name, "prompt": "x" * 2000})
        wait_for(lambda: metric(c, "tieredkv_client_disconnects_total", phase="body") == before + len(BODY_ROUTES) + 20)
        assert server_errors(c) == errors
        assert c.post("/v1/completions", json={"model": engine.model_name, "prompt": "next",
                                               "max_tokens": 2}).status_code == 200
    no_server_error_logged(logs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_while_its_answer_is_generated_and_mid_stream(engine, logs, path) -> None:
    chat = path.endswith("chat/completions")
    prompt = (lambda text: {"messages": [{"role": "user", "content": text}]}) if chat else \
        (lambda text: {"prompt": text})
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        queued, streaming = (metric(c, "tieredkv_client_disconnects_total", phase=p) for p in ("queued", "streaming"))
        payload = json.dumps({"model": engine.model_name, **prompt("go"), "max_tokens": LONG, "ignore_eos": True,
                              "user": f"t-gone-queued-{chat}"}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
        wait_for(lambda: any(q.tenant == f"t-gone-queued-{chat}" and q.output_ids
                             for q in list(engine.scheduler.running)))
        sock.close()
        wait_for(lambda: lines(logs, path, 499))
        assert lines(logs, path, 499)[0].levelno == logging.INFO
        assert metric(c, "tieredkv_client_disconnects_total", phase="queued") == queued + 1

        body = {"model": engine.model_name, **prompt("go on"), "max_tokens": LONG, "ignore_eos": True, "stream": True,
                "user": f"t-gone-streaming-{chat}"}
        with httpx.Client(base_url=s.url, timeout=60) as gone, gone.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_for(lambda: metric(c, "tieredkv_client_disconnects_total", phase="streaming") == streaming + 1)
        wait_for(lambda: idle(engine))
        assert pages_held(engine) == 0
        (line,) = [r for r in logs.records if r.name == "tieredkv.requests"
                   and r.request_fields.get("tenant") == f"t-gone-streaming-{chat}"]
        assert line.levelno == logging.INFO and line.request_fields["status"] == 200     # what the client got
        assert "the client disconnected after" in line.request_fields["reason"]
        assert server_errors(c) == 0
    no_server_error_logged(logs)


@pytest.fixture(scope="module")
def one_seat_engine(tmp_path_factory, tokenizer):
    """One sequence at a time: a second request waits in the queue while the first generates."""
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory="1MiB", host_memory="512KiB",
                        disk_dir=str(tmp_path_factory.mktemp("one-seat") / "kv"), disk_capacity="64MiB")
    eng = Engine.from_loaded(loaded, cache, max_seqs=1)
    yield eng
    eng.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_gone_while_its_request_waits_in_the_queue(one_seat_engine, logs, stream) -> None:
    eng = one_seat_engine
    tenant = f"t-waiting-{stream}"
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        queued = metric(c, "tieredkv_client_disconnects_total", phase="queued")
        payload = json.dumps({"model": eng.model_name, "prompt": "go", "max_tokens": LONG, "ignore_eos": True,
                              "user": "t-seat"}).encode()
        busy = socket.create_connection(("127.0.0.1", s.port))
        busy.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: any(q.tenant == "t-seat" and q.output_ids for q in list(eng.scheduler.running)))
        payload = json.dumps({"model": eng.model_name, "prompt": "wait", "max_tokens": 4, "stream": stream,
                              "user": tenant}).encode()
        waiting = socket.create_connection(("127.0.0.1", s.port))
        waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: any(q.tenant == tenant for q in list(eng.scheduler.waiting)))
        waiting.close()
        busy.close()
        wait_for(lambda: len(lines(logs, "/v1/completions", 499)) == 2)
        assert {r.levelno for r in lines(logs, "/v1/completions", 499)} == {logging.INFO}
        assert metric(c, "tieredkv_client_disconnects_total", phase="queued") == queued + 2
        wait_for(lambda: idle(eng))
        assert pages_held(eng) == 0 and server_errors(c) == 0
    no_server_error_logged(logs)
