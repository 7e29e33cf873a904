"""Issue 17, items 2 and 3: /health is liveness, /ready is readiness with each tier's state, and a
full filesystem is never a failed request. A real HTTP server on loopback, its cache and ledger on
a real tmpfs filled to the last byte."""
from __future__ import annotations

import logging
import os
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


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _serve_some(c, eng, n: int = 6) -> None:
    for i in range(n):
        r = c.post(COMPL, json={"model": eng.model_name, "prompt": f"tell me about the number {i} " * 6,
                                "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("change", ["garbage", "zero-meta"])
def test_a_disk_tier_damaged_while_serving_leaves_every_health_route_answering(tmp_path: Path, tokenizer,
                                                                               change: str) -> None:
    """Issue 28, item 2: garbage in data.mdb (or its meta pages zeroed) while serving left the disk
    tier dead and /ready, /v1/cache/status and POST /v1/cache/flush answering 500, and shutdown
    logged "Application shutdown failed". Now the store is moved aside at the next touch and a
    fresh one serves: the routes answer, the flush's blocks land in the fresh store."""
    eng = build_engine(tmp_path, tokenizer)
    data = tmp_path / "kv" / "data.mdb"
    lifespan = Records()                          # uvicorn's own logger does not reach the root's
    logging.getLogger("uvicorn.error").addHandler(lifespan)
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        _serve_some(c, eng)
        first = c.post("/v1/cache/flush", json={})
        assert first.status_code == 200 and first.json()["complete"] is True, first.text
        size = data.stat().st_size
        with open(data, "r+b") as f:
            f.write(os.urandom(size) if change == "garbage" else bytes(2 * 4096))
        ready = c.get("/ready")
        assert ready.status_code == 200, ready.text          # a smaller cache, still ready
        assert ready.json()["tiers"]["disk"] == "recovered" and "FileChanged" in ready.json()["disk"]["recovered"]
        assert c.get("/health").status_code == 200
        status = c.get("/v1/cache/status")
        assert status.status_code == 200 and status.json()["tiers"]["disk"]["moved_aside"] == 1, status.text
        _serve_some(c, eng)
        flushed = c.post("/v1/cache/flush", json={})
        assert flushed.status_code == 200, flushed.text
        body = flushed.json()
        assert body["complete"] is True and body["held"] == body["blocks"] > 0, body   # all in the fresh store
        assert first.json()["held"] == first.json()["blocks"] > 0
        assert body["cache"]["tiers"]["disk"]["blocks"] == body["blocks"]
    logging.getLogger("uvicorn.error").removeHandler(lifespan)
    assert not [r for r in lifespan.records if "shutdown failed" in r.getMessage()], lifespan.records
    assert [p for p in tmp_path.iterdir() if ".damaged-" in p.name]


def test_a_read_only_cache_dir_starts_a_server_without_its_disk_tier(tmp_path: Path, tokenizer, tmpfs) -> None:
    """Issue 28, item 4: OSError EROFS on '<cache>/kv.open-lock' stopped the server from starting.
    Now the disk tier is off, and the startup summary and /ready say why (the ledger lives
    elsewhere here: a read-only ledger is engine/billing's to handle)."""
    from engine.model import model_from_config
    from service.summary import startup_summary
    from tests.service.tiny_engine import BLOCK_SIZE, tiny_config
    from tests.storage.test_disk_liveness import read_only_dir
    from tieredkv import CacheConfig, Engine
    ro = read_only_dir(tmp_path, tmpfs)
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory="1MiB", host_memory="512KiB",
                        disk_dir=str(ro / "kv"), disk_capacity="64MiB")
    eng = Engine.from_loaded(loaded, cache, ledger_dir=str(tmp_path / "billing"))
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        rows = dict(startup_summary(eng, s.url))
        assert "unavailable" in rows["disk tier"] and "not writable" in rows["disk tier"], rows["disk tier"]
        _serve_some(c, eng, 2)
        ready = c.get("/ready")
        assert ready.status_code == 200 and ready.json()["tiers"]["disk"] == "unavailable", ready.text
        assert "not writable" in ready.json()["disk"]["unavailable"]
        flushed = c.post("/v1/cache/flush", json={})
        assert flushed.status_code == 200, flushed.text
