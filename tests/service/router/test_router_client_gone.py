"""Issue 41, item 2, in the router: a client that leaves before its body was read, while its
request runs on a backend, or mid-stream is one INFO line and a count in
`tieredkv_router_client_disconnects_total{phase}`, never a 500 or a traceback, never the
backend's fault (not ejected); the backend's request is cut off (it aborts it: its own
client-disconnect count rises).

A real router in front of one real tiny-engine server on loopback; raw-socket clients.
"""
from __future__ import annotations

import json
import logging
import re
import socket

import httpx
import pytest

from tests.service.conftest import ServerThread
from tests.service.router.harness import MODEL, RouterThread, events_kw, wait_for
from tests.service.test_client_disconnect import idle, pages_held
from tests.service.tiny_engine import build_engine

LONG = 900


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{sel}}} (\S+)$", c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def send(port: int, body: dict, half: bool = False) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload[:len(payload) // 2] if half else payload))
    return sock


@pytest.fixture(scope="module")
def backend(tmp_path_factory, tokenizer):
    with ServerThread(build_engine(tmp_path_factory.mktemp("gone") / "a", tokenizer, **events_kw())) as a:
        yield a


def test_clients_gone_at_each_phase_are_counted_and_cut_off(backend, caplog) -> None:
    caplog.set_level(logging.INFO)
    engine = backend.engine
    port = lambda r: int(r.url.rsplit(":", 1)[1])        # noqa: E731
    with RouterThread(backend.url) as r, r.client() as rc, backend.client() as bc:
        gone = lambda phase: metric(rc, "tieredkv_router_client_disconnects_total", phase=phase)   # noqa: E731
        at_backend = lambda phase: metric(bc, "tieredkv_client_disconnects_total", phase=phase)    # noqa: E731
        before = {p: gone(p) for p in ("body", "queued", "streaming")}
        backend_before = {p: at_backend(p) for p in ("queued", "streaming")}

        for _ in range(10):           # headers and half a body, then gone
            send(port(r), {"model": MODEL, "prompt": "x" * 500}, half=True).close()
        wait_for(lambda: gone("body") == before["body"] + 10, what="10 body disconnects counted")

        sock = send(port(r), {"model": MODEL, "prompt": "go", "max_tokens": LONG, "ignore_eos": True,
                              "user": "t-router-queued"})
        wait_for(lambda: any(q.tenant == "t-router-queued" and q.output_ids for q in list(engine.scheduler.running)))
        sock.close()
        wait_for(lambda: gone("queued") == before["queued"] + 1, what="the queued disconnect counted")
        wait_for(lambda: at_backend("queued") == backend_before["queued"] + 1, what="the backend's request cut off")

        body = {"model": MODEL, "prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "stream": True,
                "user": "t-router-stream"}
        with httpx.Client(base_url=r.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            assert next(line for line in s.iter_lines() if line.startswith("data: "))
        wait_for(lambda: gone("streaming") == before["streaming"] + 1, what="the mid-stream disconnect counted")
        wait_for(lambda: at_backend("streaming") == backend_before["streaming"] + 1, what="the backend's stream cut")
        wait_for(lambda: idle(engine), what="the backend idle")
        assert pages_held(engine) == 0
        assert r.backend_view(backend.url)["healthy"]        # a client leaving is not the backend's fault
        assert 'status="5' not in rc.get("/metrics").text
        ok = rc.post("/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    said = [rec for rec in caplog.records if rec.name == "tieredkv.router" and "client disconnected" in rec.getMessage()]
    assert len(said) == 12 and {rec.levelno for rec in said} == {logging.INFO}
    bad = [rec for rec in caplog.records if rec.levelno >= logging.WARNING or rec.exc_info]
    assert not bad, [(rec.name, rec.getMessage()) for rec in bad]
