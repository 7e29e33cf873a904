"""bench_ttft --restore-policy's targets (tools/ttft_policy_report.py) judged on given samples, and
the stalled store's stop/resume (tools/ttft_sources.py's Stall) on a real valkey-server: it is
resumed when the block raises, and by its guard while a caller still waits on it."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tools.ttft_policy_report import report_rows, summary
from tools.ttft_sources import Source, Stall
from tools.valkey_servers import ValkeyServer


def _bench(label: str, samples: dict, overhead_s: float = 0.0):
    """PolicyBench's samples: (kind, n, column) -> [(ttft_s, recomputed, hit tokens, guard fired)]."""
    return SimpleNamespace(source=Source(label, "remote" if label.startswith(("remote", "stalled")) else label,
                                         "x"), samples=samples, overhead_s=overhead_s)


def test_each_target_is_judged_where_the_issue_says() -> None:
    n = 1024
    disk = _bench("disk", {
        ("steady", n, "miss"): [(1.0, 0, 0, False)],
        ("steady", n, "device"): [(0.1, 0, 0, False)],
        ("steady", n, "load"): [(0.2, 0, n, False)],
        ("steady", n, "recompute"): [(1.0, n, n, False)],
        ("steady", n, "auto"): [(0.3, 0, n, False)],          # decided as the faster (load): (a) not judged
        ("first", n, "miss"): [(1.0, 0, 0, False)],
        ("first", n, "auto"): [(1.2, 0, n, False)],           # the first hit: 1.2x its miss, missed
    })
    link = _bench("remote@5Mbit", {
        ("steady", n, "miss"): [(1.0, 0, 0, False)],
        ("steady", n, "device"): [(0.1, 0, 0, False)],
        ("steady", n, "load"): [(1.2, 0, n, False)],
        ("steady", n, "recompute"): [(1.0, n, n, False)],     # within 1.5x of load at 1024: (b) judged
        ("steady", n, "auto"): [(0.7, 512, n, False)],        # split: differs from the faster, (a) judged
    }, overhead_s=0.1)
    stalled = _bench("stalled", {
        ("steady", n, "miss"): [(1.0, 0, 0, False)],
        ("steady", n, "device"): [(0.1, 0, 0, False)],
        ("steady", n, "load"): [(1.15, 0, 0, True)],
        ("steady", n, "recompute"): [(1.15, 0, 0, False)],
        ("steady", n, "auto"): [(1.15, 0, 0, False)],
    })
    rows = {(r["source"], r["kind"]): r for r in report_rows([disk, link, stalled], [n])}
    assert set(rows) == {("disk", "steady"), ("disk", "first"), ("remote@5Mbit", "steady"), ("stalled", "steady")}

    t = rows[("disk", "steady")]["targets"]
    assert t["hit"] == {"ratio": 0.3, "target": 1.1, "met": True}
    assert t["pick"]["faster"] == "load" and t["pick"]["auto_decisions"] == ["load"]
    assert t["pick"]["judged"] is False and t["pick"]["met"] is None
    assert t["split"]["close"] is False and t["split"]["judged"] is False
    first = rows[("disk", "first")]
    assert first["targets"] == {"hit": {"ratio": 1.2, "target": 1.1, "met": False}, "pick": None, "split": None}

    t = rows[("remote@5Mbit", "steady")]["targets"]
    assert t["pick"]["auto_decisions"] == ["split"] and t["pick"]["judged"] and t["pick"]["met"] is True
    assert t["split"]["judged"] and t["split"]["met"] is True           # 0.7 <= 0.75 x 1.0
    assert t["split"]["floor_s"] == 0.2 and t["split"]["feasible"] is True
    assert rows[("remote@5Mbit", "steady")]["auto_split"] == [{"recomputed_tokens": 512, "loaded_tokens": 512}]

    st = rows[("stalled", "steady")]
    assert st["targets"]["hit"] == {"ratio": 1.15, "target": 1.2, "met": True}   # the stalled store's target
    assert st["targets"]["pick"]["auto_decisions"] == ["miss"] and st["guard_fired"] == 1

    s = summary(list(rows.values()))
    assert s["hit"] == {"judged": 4, "met": 3, "all_met": False}
    assert s["pick"] == {"judged": 2, "met": 2, "all_met": True}
    assert s["split"]["judged"] == 1 and s["split"]["all_met_where_feasible"] is True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture()
def own_server():
    server = ValkeyServer().start()
    try:
        yield server
    finally:
        server.cleanup()


def test_a_stalled_store_is_resumed_when_the_block_raises(own_server) -> None:
    stall = Stall(own_server, guard_s=3600)
    with pytest.raises(KeyboardInterrupt):
        with stall.stalled():
            deadline = time.monotonic() + 60      # a hang guard: SIGSTOP is delivered asynchronously
            while _state(own_server.proc.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _state(own_server.proc.pid) == "T"
            raise KeyboardInterrupt
    assert _state(own_server.proc.pid) != "T" and stall.fired == 0


def test_the_guard_resumes_a_store_a_request_still_waits_on(own_server) -> None:
    stall = Stall(own_server, guard_s=0.2)
    with stall.stalled():
        deadline = time.monotonic() + 60          # a hang guard, not a bound on the timer
        # Resumed by the guard, never by us: wait for the guard to fire (SIGSTOP is delivered
        # asynchronously, so "not stopped yet" and "resumed" look alike to a poll of the state).
        while stall.fired == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        while _state(own_server.proc.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(own_server.proc.pid) != "T"
    assert stall.fired == 1
