"""A server in its own process: kill -9 under load, restart on the same cache dir; graceful SIGTERM."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.service.conftest import ServerProcess, check_usage
from tests.service.tiny_engine import BLOCK_SIZE, build_engine
from engine.billing import Ledger

PROMPT = "Blocks that reached the disk tier survive the process: a restarted server restores them from LMDB"


def model_of(c: httpx.Client) -> str:
    return c.get("/v1/models").json()["data"][0]["id"]


def post(c: httpx.Client, model: str, prompt, **kw) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0, **kw})


def full_blocks(n: int) -> int:
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_kill_9_under_load_then_restart(tmp_path, tokenizer_dir, tokenizer):
    cache = tmp_path / "cache"
    ids = tokenizer(PROMPT)["input_ids"]
    completed: list[str] = []                  # x-request-id of every 200 response
    srv = ServerProcess(cache, tokenizer_dir)
    try:
        with srv.client() as c:
            model = model_of(c)
            r = post(c, model, ids, max_tokens=4)
            assert r.status_code == 200
            completed.append(r.headers["x-request-id"])
            assert c.post("/v1/cache/flush", json={}).status_code == 200      # PROMPT's blocks are on disk now

        stop = threading.Event()

        def load(w: int) -> None:
            with srv.client() as c:
                i = 0
                while not stop.is_set():
                    try:
                        r = post(c, model, f"load from worker {w}, request {i}: {PROMPT[: 10 + i % 40]}",
                                 max_tokens=8, user=f"load-{w % 2}")
                    except httpx.TransportError:
                        return                  # the server died under us
                    if r.status_code == 200:
                        completed.append(r.headers["x-request-id"])
                    i += 1

        workers = [threading.Thread(target=load, args=(w,)) for w in range(6)]
        for t in workers:
            t.start()
        deadline = time.monotonic() + 60
        while len(completed) < 25:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(srv.proc.pid, signal.SIGKILL)
        stop.set()
        for t in workers:
            t.join(timeout=60)
        assert srv.proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        srv.stop()

    again = ServerProcess(cache, tokenizer_dir)
    try:
        with again.client() as c:
            r = post(c, model_of(c), ids, max_tokens=4)
            assert r.status_code == 200
            usage = r.json()["usage"]
            check_usage(usage)
            assert usage["prompt_cache_hit_tokens_by_tier"] == {"device": 0, "host": 0, "disk": full_blocks(len(ids)), "remote": 0}
            completed.append(r.headers["x-request-id"])
            # The ledger, read by another process while the server holds it open.
            ledger = Ledger(cache / "billing", readonly=True)
            try:
                ledger.check()                 # every total equals the sum of its request records
                recorded = {rid for rid, _ in ledger.records()}
                assert set(completed) <= recorded, "a request answered 200 is missing from the ledger"
                assert len(completed) == len(set(completed))
                assert ledger.summary()["total"]["requests"] == len(recorded)
            finally:
                ledger.close()
            billing = c.get("/v1/cache/billing").json()
            assert billing["total"]["requests"] == len(recorded)
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(timeout=60) == 0
        again.stop()


def test_sigterm_finishes_in_flight_requests_flushes_and_exits_0(tmp_path, tokenizer_dir, tokenizer):
    cache = tmp_path / "cache"
    ids = tokenizer(PROMPT + " (graceful)")["input_ids"]
    srv = ServerProcess(cache, tokenizer_dir)
    result = {}
    try:
        with srv.client() as c:
            model = model_of(c)

            def long_request() -> None:
                with srv.client() as c2:
                    result["r"] = post(c2, model, ids, max_tokens=300, ignore_eos=True)

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.monotonic() + 60
            while c.get("/health").json()["in_flight"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0
        assert "EXITED CLEANLY" in srv.proc.stdout.read()
    finally:
        srv.stop()
    r = result["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300
    request_id = r.headers["x-request-id"]

    # engine.close() flushed the device pool to disk: an engine on the same cache dir (built
    # here, in-process: a third server start would only cost time) finds the prompt on disk.
    engine = build_engine(cache, tokenizer)
    try:
        assert engine.lookup(ids).hit_tokens_by_tier == {"device": 0, "host": 0, "disk": full_blocks(len(ids)), "remote": 0}
        assert [rid for rid, _ in engine.ledger.records()] == [request_id]
        bill = engine.ledger.tenant("default")
        assert bill.requests == 1 and bill.completion_tokens == 300
    finally:
        engine.close()
