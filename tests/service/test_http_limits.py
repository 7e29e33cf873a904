"""Issue 44, item 5: HTTP limits a slow or hostile client meets (service/read_limits.py), and the
in-flight bounds beside a batch of prompts.

A real server on loopback with the tiny engine (serve()'s uvicorn config: tests/service/conftest.py);
the clients are raw sockets. A partial request line and headers is answered 408 and closed after
--header-timeout while others are served; a body that trickles is cut after --body-timeout (it is a
deadline, not a wait between bytes); a chunk-size line past --max-body is a 413 at once, with the
timeouts long. A 2,048-prompt batch, which the README allows, is answered whole; past the
requests in flight (max_queue) a request gets 429 while the batch runs.
"""
from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest

from service.settings import ServiceSettings
from tests.service.conftest import ServerThread

GENEROUS_S = 60.0        # how long a test waits for the server to act before calling it a failure
HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(GENEROUS_S)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket.timeout: it never did)."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    return data


def answer(data: bytes) -> tuple[int, dict]:
    """A raw HTTP response's status and its JSON body."""
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


def status_lines(caplog, status: int) -> list[dict]:
    return [r.request_fields for r in caplog.records if r.name == "tieredkv.requests"
            and r.request_fields["status"] == status]


@pytest.fixture(scope="module")
def impatient(engine):
    """A server with one-second read limits."""
    with ServerThread(engine, ServiceSettings(header_timeout_s=1.0, body_timeout_s=1.0,
                                              close_engine_on_shutdown=False)) as s:
        yield s


def test_partial_headers_are_answered_408_and_closed_while_others_are_served(impatient, engine) -> None:
    """The attack: a request line and half its headers, then nothing, held open forever."""
    slow = [connect(impatient.port) for _ in range(20)]
    for sock in slow:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Ty")
    silent = connect(impatient.port)          # says nothing at all
    with impatient.client() as c:             # served meanwhile
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": engine.model_name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    for sock in slow:
        status, body = answer(read_to_close(sock))
        assert status == 408 and body["error"]["code"] == "timeout", body
        assert "headers did not arrive within 1s" in body["error"]["message"]
    assert read_to_close(silent) == b""       # closed, with nothing to answer


def test_a_trickled_body_is_cut_by_its_deadline_with_408(impatient, engine, caplog) -> None:
    """A byte every 50 ms never leaves the connection idle for a second, yet a 1,000-byte body at
    that rate would take 50 s: the body's deadline (1 s, + 1 s per 64 KiB) cuts it."""
    caplog.set_level(logging.INFO)
    payload = json.dumps({"model": engine.model_name, "prompt": "x" * 900, "max_tokens": 2}).encode()
    sock = connect(impatient.port)
    sock.sendall(HEADERS + b"Content-Length: %d\r\n\r\n" % len(payload) + payload[:10])
    sent, deadline = 10, time.monotonic() + GENEROUS_S
    while not select.select([sock], [], [], 0.05)[0]:
        assert time.monotonic() < deadline, "the trickle was never cut"
        sock.sendall(payload[sent:sent + 1])
        sent += 1
    assert sent < len(payload)
    status, body = answer(read_to_close(sock))
    assert status == 408 and "request body did not arrive within 1s" in body["error"]["message"], body
    # The app saw a disconnect; its line says what the client was answered, not a client gone (499).
    deadline = time.monotonic() + GENEROUS_S
    while not status_lines(caplog, 408):
        assert time.monotonic() < deadline, "no 408 line"
        time.sleep(0.02)
    assert status_lines(caplog, 408)[0]["path"] == "/v1/completions" and not status_lines(caplog, 499)


def test_a_stalled_body_on_a_kept_alive_connection_is_cut_too(impatient, engine) -> None:
    """A first request answered, then the next one's headers and half its body, then nothing."""
    payload = json.dumps({"prompt": "hello there"}).encode()
    request = b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" \
        % len(payload)
    sock = connect(impatient.port)
    sock.sendall(request + payload)
    first = b""
    while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {first!r}"
        first += chunk
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(request + payload[:5])
    status, body = answer(read_to_close(sock))
    assert status == 408 and body["error"]["code"] == "timeout"


def test_a_chunk_past_the_body_limit_is_refused_at_once(engine, caplog) -> None:
    """h11 takes a chunk-size of 2**64 - 1 and waits for its bytes: here the read limits are ten
    minutes, so an answer at all shows the refusal did not wait for them."""
    caplog.set_level(logging.INFO)
    settings = ServiceSettings(header_timeout_s=600.0, body_timeout_s=600.0, max_body_bytes=1 << 20,
                               close_engine_on_shutdown=False)
    chunked = (b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    with ServerThread(engine, settings) as s:
        for size in (b"FFFFFFFFFFFFFFFF", b"%x" % ((1 << 20) + 1)):
            sock = connect(s.port)
            sock.sendall(chunked + size + b"\r\n")       # and the chunk's bytes never come
            status, body = answer(read_to_close(sock))
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            assert "a chunk declares more than the server's limit of 1048576 bytes" in body["error"]["message"]
        # Chunks within the limit are read as ever.
        payload = json.dumps({"prompt": "hello there"}).encode()
        sock = connect(s.port)
        sock.sendall(chunked[:-2] + b"Connection: close\r\n\r\n"
                     + b"5\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (payload[:5], len(payload) - 5, payload[5:]))
        data = read_to_close(sock)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert len(status_lines(caplog, 413)) == 2


def test_a_2048_prompt_batch_is_answered_whole(client, engine) -> None:
    """The README allows 2,048 prompts in one request; the engine's queue (256 prompts before) refused
    more than 256 with a 400 naming max_queue."""
    prompts = [f"p{i}" for i in range(2048)]
    r = client.post("/v1/completions", json={"model": engine.model_name, "prompt": prompts, "max_tokens": 1,
                                             "user": "batch-2048"})
    assert r.status_code == 200, r.text[:500]
    assert [c["index"] for c in r.json()["choices"]] == list(range(2048))
    assert engine.ledger.tenant("batch-2048").requests == 2048


def test_past_the_requests_in_flight_a_request_gets_429_while_a_batch_runs(engine) -> None:
    """A batch is one request in flight (one worker thread), whatever its prompts; with max_queue=1 the
    next request is a 429 with Retry-After while the batch runs, and the batch is answered whole."""
    prompts = [f"q{i}" for i in range(256)]
    with ServerThread(engine, ServiceSettings(max_queue=1, close_engine_on_shutdown=False)) as s, \
            httpx.Client(base_url=s.url, timeout=600) as c, s.client() as other:
        got: dict = {}
        body = {"model": engine.model_name, "prompt": prompts, "max_tokens": 8, "ignore_eos": True,
                "user": "batch-flood"}
        batch = threading.Thread(target=lambda: got.update(r=c.post("/v1/completions", json=body)))
        batch.start()
        deadline = time.monotonic() + GENEROUS_S
        while other.get("/health").json()["in_flight"] == 0:        # admitted: 256 x 8 tokens to go
            assert time.monotonic() < deadline and batch.is_alive(), "the batch was never in flight"
            time.sleep(0.005)
        r = other.post("/v1/completions", json={"model": engine.model_name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert r.headers["retry-after"] == "1"
        batch.join()
        assert got["r"].status_code == 200, got["r"].text[:500]
        choices = got["r"].json()["choices"]
        assert len(choices) == 256 and all(ch["finish_reason"] == "length" for ch in choices)
