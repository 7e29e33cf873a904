"""Issue 17, items 2 and 3: /health is liveness, /ready is readiness with each tier's state, and a
full filesystem is never a failed request. A real HTTP server on loopback, its cache and ledger on
a real tmpfs filled to the last byte."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.settings import ServiceSettings
from tests.engine.test_billing_full_disk import fill
from tests.service.conftest import ServerThread
from tests.service.tiny_engine import build_engine

COMPL = "/v1/completions"


@pytest.fixture
def small_fs(tmpfs) -> Path:
    return tmpfs("24m")


def test_ready_reports_each_tier_and_a_full_filesystem_fails_no_request(small_fs: Path, tokenizer) -> None:
    eng = build_engine(small_fs, tokenizer, disk_reserve="1MiB")
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        r = c.get("/ready")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ready"] is True and body["tiers"] == {"device": "ok", "host": "ok", "disk": "ok", "remote": "off"}
        assert body["billing"]["state"] == "ok"
        fillers = [fill(small_fs)]
        statuses = []
        for i in range(40):             # the ledger's reserve goes first, then bills wait in memory
            r = c.post(COMPL, json={"model": eng.model_name, "prompt": f"request {i} " * 8, "max_tokens": 2})
            statuses.append(r.status_code)
            if i == 10:
                fillers.append(fill(small_fs))   # what the ledger's reserve gave back, taken too
        assert statuses == [200] * 40           # issue 17: HTTP 500 on 10 of 10
        assert c.get("/health").status_code == 200          # alive: nothing to restart
        ready = c.get("/ready")
        assert ready.status_code == 503 and not ready.json()["ready"], ready.text
        assert any("billing cannot be written" in why for why in ready.json()["reasons"])
        assert c.get("/v1/cache/status").json()["billing"]["state"] == "degraded"
        unwritten = [line for line in c.get("/metrics").text.splitlines() if line.startswith("tieredkv_billing_unwritten ")]
        assert unwritten and float(unwritten[0].split()[1]) > 0, unwritten
        assert "tieredkv_disk_unavailable 0.0" in c.get("/metrics").text
        for f in fillers:
            f.unlink()
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get("/ready").status_code == 200
    assert eng.ledger is not None


def test_health_is_503_once_the_engine_loop_stopped(tmp_path: Path, tokenizer) -> None:
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        assert c.get("/health").status_code == 200
        eng.close()
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        ready = c.get("/ready")
        assert ready.status_code == 503 and "the engine loop has stopped" in ready.json()["reasons"]
