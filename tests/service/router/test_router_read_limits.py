"""Issue 44, item 5, in the router: the same read limits as a backend's (service/read_limits.py).
Partial headers are answered 408 and closed; a trickled body is cut with a 408, which is not a
client that left (no 499 counted); a chunk-size line past --max-body is a 413 at once.

A real router on loopback (under serve_router's uvicorn config); its one backend is a port nobody
listens on, as no request here gets as far as a backend. The clients are raw sockets.
"""
from __future__ import annotations

import json
import select
import time

from tests.service.router.harness import RouterThread
from tests.service.router.test_router_client_gone import metric
from tests.service.test_http_limits import GENEROUS_S, HEADERS, answer, connect, read_to_close

NOBODY = "http://127.0.0.1:9"


def test_slow_clients_are_cut_and_not_counted_as_gone() -> None:
    with RouterThread(NOBODY, header_timeout_s=1.0, body_timeout_s=1.0) as r, r.client() as c:
        port = int(r.url.rsplit(":", 1)[1])
        gone = metric(c, "tieredkv_router_client_disconnects_total", phase="body")
        partial = connect(port)
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        trickle = connect(port)
        payload = json.dumps({"model": "m", "prompt": "x" * 900}).encode()
        trickle.sendall(HEADERS + b"Content-Length: %d\r\n\r\n" % len(payload))
        sent, deadline = 0, time.monotonic() + GENEROUS_S
        while not select.select([trickle], [], [], 0.05)[0]:
            assert time.monotonic() < deadline, "the trickle was never cut"
            trickle.sendall(payload[sent:sent + 1])
            sent += 1
        status, body = answer(read_to_close(trickle))
        assert status == 408 and "request body did not arrive" in body["error"]["message"], body
        status, body = answer(read_to_close(partial))
        assert status == 408 and "headers did not arrive" in body["error"]["message"], body
        assert c.get("/health").json()["backends"][0]["url"] == NOBODY     # answered throughout (503: no backend up)
        assert metric(c, "tieredkv_router_client_disconnects_total", phase="body") == gone


def test_a_chunk_past_the_body_limit_is_refused_at_once() -> None:
    with RouterThread(NOBODY, header_timeout_s=600.0, body_timeout_s=600.0) as r:
        sock = connect(int(r.url.rsplit(":", 1)[1]))
        sock.sendall(HEADERS + b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\n")
        status, body = answer(read_to_close(sock))
        assert status == 413 and body["error"]["code"] == "request_too_large", body
