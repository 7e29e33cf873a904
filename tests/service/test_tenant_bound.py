"""A tenant's bound on requests in flight (--max-inflight-per-tenant): past it a 429 with
OpenAI's error body and Retry-After, while another tenant is admitted; the default leaves a
quarter of the engine's batch to the others. A real server on loopback with the tiny engine."""
from __future__ import annotations

import time

import httpx
import pytest

from service.settings import ServiceSettings, per_tenant_bound
from tests.service.conftest import ServerThread

COMPL = "/v1/completions"
LONG = 900


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_tenant_over_its_bound_gets_429_with_retry_after_while_another_is_admitted(engine):
    settings = ServiceSettings(max_inflight_per_tenant=2, close_engine_on_shutdown=False)
    long = {"model": engine.model_name, "prompt": "go", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "user": "tenant-a"}
    with ServerThread(engine, settings) as s, s.client() as c, httpx.Client(base_url=s.url, timeout=60) as a:
        streams = [a.stream("POST", COMPL, json=long) for _ in range(2)]
        try:
            for cm in streams:
                assert cm.__enter__().status_code == 200        # admitted (the first chunk came)
            dispatcher = s.app.state.tieredkv.dispatcher
            assert dispatcher.in_flight_of("tenant-a") == 2
            for stream in (False, True):
                r = c.post(COMPL, json={**long, "stream": stream, "max_tokens": 2})
                assert r.status_code == 429
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"] == {
                    "message": "tenant 'tenant-a' has 2 requests in flight, the most one tenant may have "
                               "(--max-inflight-per-tenant); retry when one has finished",
                    "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
            b = c.post(COMPL, json={"model": engine.model_name, "prompt": "hi", "max_tokens": 3, "user": "tenant-b"})
            assert b.status_code == 200 and b.json()["usage"]["completion_tokens"] == 3
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)                   # hang up: both are aborted
        wait_for(lambda: dispatcher.in_flight_of("tenant-a") == 0)
        r = c.post(COMPL, json={**long, "stream": False, "max_tokens": 2})
        assert r.status_code == 200                             # room again once they ended


def test_the_default_bound_is_three_quarters_of_the_batch(engine):
    assert per_tenant_bound(None, 64, 256) == 48
    assert per_tenant_bound(None, 1, 256) == 1
    assert per_tenant_bound(None, 64, 10) == 10                 # never past the server's own bound
    assert per_tenant_bound(5, 64, 256) == 5
    assert per_tenant_bound(None, None, 256) == 256             # an engine that does not say its batch
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s:
        assert s.app.state.tieredkv.dispatcher.max_per_tenant == engine.max_seqs * 3 // 4
    with pytest.raises(ValueError, match="max_inflight_per_tenant"):
        ServiceSettings(max_inflight_per_tenant=0)
