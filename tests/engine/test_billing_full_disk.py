"""Issue 17, item 2: a full filesystem is never a failed request, and billing is never lost silently.

On a real tmpfs filled to the last byte: the default policy answers the request once its bill is
held in the ledger's reserve (status: degraded, counting every bill not yet committed), and
commits it when space returns; "refuse" fails the request instead; a process closing without a
reserve spills the bills it held in memory to a file that the next open commits. Counters and
events, no wall-clock bounds.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from engine.billing import Ledger
from engine.billing_spill import RESERVE_FILE, SPILL_PREFIX
from engine.billing_writer import BillingWriter
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams


@pytest.fixture
def small_fs(tmpfs) -> Path:
    return tmpfs("16m")


def fill(mnt: Path, leave: int = 0) -> Path:
    """Fill the filesystem, leaving about `leave` bytes; returns the (new) filler file."""
    filler = mnt / f"filler-{len(list(mnt.glob('filler-*')))}"
    with open(filler, "wb") as f:
        try:
            while True:
                st = os.statvfs(mnt)
                left = st.f_bavail * st.f_frsize - leave
                if left <= 0:
                    break
                f.write(b"\1" * min(left, 1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def entry(ledger: Ledger, i: int, tenant: str = "acme"):
    return ledger.prepare(tenant, f"req-{i}", 32, 4, {"disk": 16}, 16)


def wait_until(cond, deadline_s: float = 60.0) -> bool:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def submit_and_wait(writer: BillingWriter, e):
    got = threading.Event()
    result = {}

    def done(recorded, error):
        result.update(recorded=recorded, error=error)
        got.set()
    writer.submit(e, done)
    assert got.wait(60)
    return result


def test_serve_holds_bills_in_the_reserve_until_space_returns_and_ok_means_every_one_is_committed(small_fs: Path) -> None:
    """Formerly test_the_reserve_gives_the_ledger_room_then_serve_keeps_bills_in_memory_until_space_returns,
    which failed 1 of 5 runs beside two CPU burners: the retry took the held bills out of the
    count before committing them, so status said "ok" with 180 bills still unwritten."""
    ledger = Ledger(small_fs / "billing")
    writer = BillingWriter(ledger, reserve_bytes=2 << 20)
    try:
        assert (small_fs / "billing" / RESERVE_FILE).stat().st_size == writer.status()["reserve"] == 2 << 20
        for i in range(20):
            assert submit_and_wait(writer, entry(ledger, i)) == {"recorded": True, "error": None}
        filler = fill(small_fs)
        # No commit fits now. The requests are answered (no error) once their bills are in the
        # reserve; the operator sees every one of them.
        answered = [submit_and_wait(writer, entry(ledger, i)) for i in range(20, 200)]
        assert all(a["error"] is None for a in answered)
        status = writer.status()
        assert status["state"] == "degraded" and status["unwritten"] == 180 and status["error"], status
        assert status["held_in"] == "reserve" and status["reserve_used"] > 0
        # Space returns: every bill is committed by the writer's retry, exactly once.
        filler.unlink()
        assert wait_until(lambda: writer.status()["state"] == "ok")
        assert ledger.tenant("acme").requests == 200
        ledger.check()
        assert writer.status()["reserve_used"] == 0        # its journal emptied
    finally:
        writer.close()
        ledger.close()


def test_status_counts_the_bills_a_retry_has_in_hand_until_they_are_committed(small_fs: Path) -> None:
    """The race behind the flaky test, made certain: the retry's commit is held open (the real
    commit runs once it is let go); meanwhile status must not say "ok"."""
    ledger = Ledger(small_fs / "billing")
    writer = BillingWriter(ledger, reserve_bytes=1 << 20)
    commit, in_commit, go = ledger.record_many, threading.Event(), threading.Event()
    try:
        filler = fill(small_fs)
        for i in range(10):
            assert submit_and_wait(writer, entry(ledger, i))["error"] is None
        assert writer.status()["unwritten"] == 10

        def held_commit(entries):
            in_commit.set()
            assert go.wait(60)
            return commit(entries)
        ledger.record_many = held_commit
        filler.unlink()                  # the next retry (RETRY_S) commits them
        assert in_commit.wait(60)
        status = writer.status()
        assert status["state"] == "degraded" and status["unwritten"] == 10, status
        go.set()
        assert wait_until(lambda: writer.status()["state"] == "ok")
        assert ledger.tenant("acme").requests == 10
    finally:
        go.set()
        writer.close()
        ledger.close()


def test_refuse_fails_the_request_when_the_ledger_cannot_be_written(small_fs: Path) -> None:
    ledger = Ledger(small_fs / "billing")
    writer = BillingWriter(ledger, on_failure="refuse", reserve_bytes=0)
    try:
        filler = fill(small_fs)
        results = [submit_and_wait(writer, entry(ledger, i)) for i in range(200)]
        failed = [r for r in results if r["error"] is not None]
        assert failed and all(r["recorded"] is None for r in failed)
        # Nothing kept (the callers were told), but the ledger cannot be written: degraded (/ready
        # 503, issue 41), new requests refused at admission, until a probe write succeeds.
        status = writer.status()
        assert status["state"] == "degraded" and status["unwritten"] == 0, status
        assert writer.refusing() is not None
        filler.unlink()
        assert wait_until(lambda: writer.status()["state"] == "ok"), writer.status()
        assert writer.refusing() is None
        ledger.check()
    finally:
        writer.close()
        ledger.close()


def test_closing_without_a_reserve_spills_the_bills_held_in_memory_and_the_next_open_commits_them(small_fs: Path) -> None:
    ledger = Ledger(small_fs / "billing")
    writer = BillingWriter(ledger, reserve_bytes=0)       # none: bills are held in memory only
    crumb = small_fs / "crumb"
    crumb.write_bytes(b"\1" * 8192)      # freed before closing: room for a spill file, not a commit
    filler = fill(small_fs)
    try:
        for i in range(400):
            submit_and_wait(writer, entry(ledger, i))
            if writer.status()["state"] == "degraded":
                break
        assert writer.status()["state"] == "degraded" and writer.status()["held_in"] == "memory"
        crumb.unlink()
    finally:
        writer.close()
        ledger.close()
    spills = [p for p in (small_fs / "billing").iterdir() if p.name.startswith(SPILL_PREFIX)]
    assert writer.spilled >= 1 and len(spills) == 1, (writer.spilled, spills)
    filler.unlink()
    with Ledger(small_fs / "billing") as again:       # reads the spill back, then deletes it
        assert again.tenant("acme").requests == i + 1   # every answered request billed, once
        again.check()
    assert not [p for p in (small_fs / "billing").iterdir() if p.name.startswith(SPILL_PREFIX)]


def test_an_engine_on_a_full_filesystem_answers_every_request_and_bills_them_when_space_returns(small_fs: Path) -> None:
    """Issue 17: 'billing failed: No space left on device' on 10 of 10 requests."""
    eng = make_engine(small_fs)
    prompts = [random_prompt(24, seed) for seed in range(8)]
    try:
        filler = fill(small_fs)
        outs = [eng.generate(p, SamplingParams(max_tokens=4)) for p in prompts * 2]   # none raises
        assert all(len(o.token_ids) == 4 for o in outs)
        filler.unlink()
        assert wait_until(lambda: eng.cache_status()["billing"]["state"] == "ok")
        assert wait_until(lambda: eng.ledger.tenant("default").requests == 16), eng.ledger.summary()
        eng.ledger.check()
    finally:
        eng.close()
