"""Issue 28, items 3 and 4, through a real server: a full filesystem at SIGTERM leaves every
served request in the ledger after a restart, and a server whose ledger cannot be opened at
start (a full filesystem) starts, serves, says so in its startup summary and /ready, and bills
once the ledger opens. Real tmpfs mounts, a real HTTP server on loopback, served counted against
billed."""
from __future__ import annotations

import signal
import time
from pathlib import Path

from engine.billing import Ledger
from service.settings import ServiceSettings
from service.summary import startup_summary
from tests.engine.test_billing_full_disk import fill
from tests.service.conftest import ServerProcess, ServerThread
from tests.service.tiny_engine import build_engine

COMPL = "/v1/completions"


def served(c, model: str, n: int, tag: str) -> list[str]:
    """x-request-id of each of n requests answered 200 (any other answer fails the test)."""
    ids = []
    for i in range(n):
        r = c.post(COMPL, json={"model": model, "prompt": f"{tag} request {i} " * 4, "max_tokens": 2})
        assert r.status_code == 200, r.text
        ids.append(r.headers["x-request-id"])
    return ids


def test_sigterm_on_a_full_filesystem_leaves_every_served_request_in_the_ledger(tmpfs, tokenizer_dir) -> None:
    """Issue 28: 30 requests on a full tmpfs, SIGTERM, restart: the ledger held 101 of 110."""
    mnt = tmpfs("48m")
    srv = ServerProcess(mnt / "cache", tokenizer_dir)
    try:
        with srv.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            ids = served(c, model, 5, "before")
            fillers = []
            for i in range(30):
                fillers.append(fill(mnt))    # to the last byte: whatever was freed meanwhile is taken too
                ids += served(c, model, 1, f"full {i}")
            ready = c.get("/ready")
            assert ready.status_code == 503 and ready.json()["billing"]["unwritten"] > 0, ready.text
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=120) == 0
    finally:
        srv.stop()
    for f in fillers:
        f.unlink()
    again = ServerProcess(mnt / "cache", tokenizer_dir)      # its open commits what the reserve holds
    try:
        with again.client() as c:
            assert c.get("/v1/cache/billing").json()["total"]["requests"] == len(ids) == 35
        with Ledger(mnt / "cache" / "billing", readonly=True) as led:
            led.check()
            assert {rid for rid, _ in led.records()} == set(ids)
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(timeout=120) == 0
        again.stop()


def test_a_server_starts_on_a_full_filesystem_with_the_ledger_off_and_says_so(tmpfs, tokenizer) -> None:
    """Issue 28: `DiskUnavailable: .../billing: the filesystem is full` and the engine did not start."""
    mnt = tmpfs("4m")
    filler = fill(mnt)
    eng = build_engine(mnt, tokenizer)
    rows = dict(startup_summary(eng, "http://127.0.0.1:1"))
    assert "unavailable" in rows["billing"] and "no reserve" in rows["billing"], rows["billing"]
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        ready = c.get("/ready")
        assert ready.status_code == 503, ready.text
        assert any("the ledger is unavailable" in why for why in ready.json()["reasons"]), ready.json()
        assert ready.json()["billing"]["reserve"] == 0
        assert c.get("/v1/cache/billing").status_code == 503
        ids = served(c, eng.model_name, 3, "ledger off")     # --on-billing-failure serve (the default)
        filler.unlink()
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get("/ready").status_code == 200, c.get("/ready").text
        assert c.get("/v1/cache/billing").json()["total"]["requests"] == len(ids)
