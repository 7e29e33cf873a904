"""A client that goes away aborts its request (engine/abort.py, service/disconnect.py): the
engine stops generating within a step, every page goes back, the abort is counted in /metrics
and said in the request's log line, and the bill is written for what reached the client.

A real server on loopback with the tiny engine; the clients hang up as real ones do (httpx
closing a stream it has not read to the end, a raw socket closed while waiting).
"""
from __future__ import annotations

import json
import logging
import re
import socket
import time

import httpx
import pytest

from tests.service.conftest import ServerThread
from service.settings import ServiceSettings

COMPL = "/v1/completions"
LONG = 900        # tokens: the request is still generating long after the client has gone


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def aborted_metric(c: httpx.Client, reason: str) -> float:
    m = re.search(rf'^tieredkv_requests_aborted_total{{reason="{reason}"}} (\S+)$', c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def bill(c: httpx.Client, tenant: str) -> dict:
    return c.get("/v1/cache/billing", params={"tenant": tenant}).json()


def idle(engine) -> bool:
    s = engine.scheduler
    return not s.running and not s.waiting and not s.loading and engine._inflight == 0


def pages_held(engine) -> int:
    pool = engine.cache.pool
    return sum(pool.refcount(p) for p in range(pool.num_pages))


def request_line(caplog, tenant: str) -> logging.LogRecord:
    found = []
    wait_for(lambda: found.extend(r for r in caplog.records if r.name == "tieredkv.requests"
                                  and r.request_fields.get("tenant") == tenant) or found)
    return found[0]


def test_a_stream_closed_after_its_first_chunk_is_aborted_and_billed_for_what_was_sent(engine, caplog):
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    body = {"model": engine.model_name, "prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "user": "t-gone-stream"}
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        before = aborted_metric(c, "client_disconnected")
        prompt_tokens = c.post("/tokenize", json={"prompt": "go on"}).json()["count"]
        with httpx.Client(base_url=s.url, timeout=60) as gone, gone.stream("POST", COMPL, json=body) as r:
            assert r.status_code == 200
            first = json.loads(next(r.iter_lines()).removeprefix("data: "))
            assert first["choices"][0]["text"]          # one chunk read, then the client hangs up
        wait_for(lambda: bill(c, "t-gone-stream")["requests"] == 1)
        wait_for(lambda: idle(engine))
        assert pages_held(engine) == 0                  # every page back to refcount 0
        assert aborted_metric(c, "client_disconnected") == before + 1
        billed = bill(c, "t-gone-stream")
        line = request_line(caplog, "t-gone-stream")
        sent = int(re.search(r"disconnected after (\d+) completion tokens", line.request_fields["reason"]).group(1))
        # Billed: the prompt as served, and exactly the completion tokens whose chunks were sent
        # (at least the one the client read; far fewer than it asked for).
        assert billed["completion_tokens"] == sent and 1 <= sent < LONG
        assert billed["prompt_tokens"] == prompt_tokens
        assert billed["miss_tokens"] + billed["hit_tokens"] == billed["prompt_tokens"]
        assert c.get("/health").json()["in_flight"] == 0
        assert c.post(COMPL, json={"model": engine.model_name, "prompt": "next", "max_tokens": 2}).status_code == 200


# One request; n choices (each billed for what reached the client: nothing); a batch of prompts
# (each its own request, each aborted and billed so).
@pytest.mark.parametrize("extra, requests", [({}, 1), ({"n": 4, "temperature": 1.0}, 1), ({"prompt": ["go", "go"]}, 2)],
                         ids=["one", "n4", "batch"])
def test_a_client_that_disconnects_while_waiting_for_its_response_aborts_the_request(engine, caplog, extra, requests):
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    tenant = f"t-gone-plain-{len(extra)}-{requests}"
    payload = json.dumps({"model": engine.model_name, "prompt": "go", "max_tokens": LONG, "ignore_eos": True,
                          "user": tenant, **extra}).encode()
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        before = aborted_metric(c, "client_disconnected")
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: any(q.tenant == tenant and q.output_ids for q in list(engine.scheduler.running)))
        sock.close()                                    # gone mid-generation
        wait_for(lambda: bill(c, tenant)["requests"] == requests)
        wait_for(lambda: idle(engine))
        assert pages_held(engine) == 0
        assert aborted_metric(c, "client_disconnected") == before + requests     # the engine's requests, as billed
        billed = bill(c, tenant)
        assert billed["completion_tokens"] == 0        # nothing of the answer reached the client
        assert billed["prompt_tokens"] == requests      # "go": admitted, its prompt served
        line = request_line(caplog, tenant)
        assert line.request_fields["status"] == 499
        assert "disconnected before its response; the request was aborted" in line.request_fields["reason"]
        assert line.request_fields["completion_tokens"] == 0
        assert c.get("/health").json()["in_flight"] == 0


def test_an_n_choice_stream_closed_mid_way_bills_each_choice_what_was_sent(engine, caplog):
    """n > 1 is billed as one choice is: the completion tokens whose chunks were sent (the
    engine runs ahead of the client by a step or more: n tokens a step), not all it generated."""
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    body = {"model": engine.model_name, "prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "n": 4, "temperature": 1.0, "seed": 3, "user": "t-gone-choices"}
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        with httpx.Client(base_url=s.url, timeout=60) as gone, gone.stream("POST", COMPL, json=body) as r:
            assert r.status_code == 200
            lines, read = r.iter_lines(), []
            while len(read) < 6:          # six chunks read, then the client hangs up
                line = next(lines)
                if line:
                    read.append(json.loads(line.removeprefix("data: ")))
            assert len({e["choices"][0]["index"] for e in read}) > 1     # the choices' chunks interleave
        wait_for(lambda: bill(c, "t-gone-choices")["requests"] == 1)
        wait_for(lambda: idle(engine))
        assert pages_held(engine) == 0
        line = request_line(caplog, "t-gone-choices")
        sent = int(re.search(r"disconnected after (\d+) completion tokens", line.request_fields["reason"]).group(1))
        assert bill(c, "t-gone-choices")["completion_tokens"] == sent and 6 <= sent < LONG
