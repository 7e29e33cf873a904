"""Issue 41, items 1 and 4, through a real server: the filesystem under the cache dir (a
loop-mounted ext4, tests/ext4_image.py) aborted while serving. With `serve` (the default) every
request is answered 200 while the bills held in memory stay within their bound, /ready is 503
naming billing, `tieredkv status` says the bills are held in memory and the disk tier's writes
are off, and once the filesystem is back every answered request is in the ledger. With `refuse`
the request gets a 503 with Retry-After and an OpenAI-style body naming billing at once --
never a 500. Skipped where the image cannot be mounted (not root).
"""
from __future__ import annotations

import subprocess
import sys
import time

from engine.engine import Engine
from engine.model import model_from_config
from service.settings import ServiceSettings
from storage.config import CacheConfig
from tests.service.conftest import REPO, ServerThread
from tests.service.test_billing_full_disk import served
from tests.service.tiny_engine import BLOCK_SIZE, build_engine, tiny_config

COMPL = "/v1/completions"


def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.1)


def status_cli(url: str) -> str:
    r = subprocess.run([sys.executable, "-m", "tieredkv.cli", "status", "--url", url], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(REPO), "COLUMNS": "300", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_serve_answers_every_request_while_the_filesystem_is_aborted_and_bills_them_once_it_is_back(
        ext4, tokenizer) -> None:
    eng = build_engine(ext4.path, tokenizer)
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        ids = served(c, eng.model_name, 5, "before")
        ext4.abort()
        ids += served(c, eng.model_name, 30, "aborted")           # 0 failed
        assert c.post("/v1/cache/flush", json={}).status_code == 200     # blocks go down: the disk's writes go off
        until(lambda: c.get("/ready").json()["tiers"]["disk"] == "writes off", "the disk tier's writes off")
        ready = c.get("/ready")
        assert ready.status_code == 503, ready.text
        why = " ".join(ready.json()["reasons"])
        assert "billing cannot be written" in why and "30 in memory" in why and "Read-only file system" in why, why
        assert 'tieredkv_billing_held_in_memory 30.0' in c.get("/metrics").text
        text = status_cli(s.url)
        assert "billing: degraded: 30 bills held in memory (30 in memory:" in text, text
        assert "disk: writes off" in text, text
        ext4.recover()
        until(lambda: c.get("/ready").status_code == 200, "/ready 200 once the filesystem is back")
        until(lambda: c.get("/ready").json()["tiers"]["disk"] == "ok", "the disk tier's writes on (its probe)")
        # /ready turns 200 once the ledger takes a commit again; the bills held meanwhile may still
        # be on their way in (seen once under load: 30 of 35 at the first read). Every one lands.
        until(lambda: c.get("/v1/cache/billing").json()["total"]["requests"] >= 35, "every bill in the ledger")
        billing = c.get("/v1/cache/billing").json()
        assert billing["total"]["requests"] == len(ids) == 35, billing
        assert 'status="500"' not in c.get("/metrics").text


def test_refuse_answers_503_with_retry_after_naming_billing_at_once(ext4, tokenizer) -> None:
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory="1MiB", host_memory="512KiB",
                        disk_dir=str(ext4.path / "kv"), disk_capacity="64MiB")
    eng = Engine.from_loaded(loaded, cache, billing_failure="refuse")
    with ServerThread(eng, ServiceSettings(close_engine_on_shutdown=True)) as s, s.client() as c:
        ids = served(c, eng.model_name, 2, "before")
        ext4.abort()
        for i in range(3):
            r = c.post(COMPL, json={"model": eng.model_name, "prompt": f"refused {i}", "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) > 0
            err = r.json()["error"]
            assert err["code"] == "billing_unavailable" and err["type"] == "service_unavailable"
            assert "billing" in err["message"] and "refuse" in err["message"], err
        ready = c.get("/ready")
        assert ready.status_code == 503, ready.text
        ext4.recover()
        until(lambda: c.get("/ready").status_code == 200, "/ready 200 once the filesystem is back")
        ids += served(c, eng.model_name, 2, "after")
        assert c.get("/v1/cache/billing").json()["total"]["requests"] == len(ids) == 4
        assert 'status="500"' not in c.get("/metrics").text
