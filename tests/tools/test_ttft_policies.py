"""The bandwidth-limited proxy (tools/throttle_proxy.py) and bench_ttft's --restore-policy mode
(tools/ttft_policies.py), run as a user runs them: a real valkey-server behind the real proxy,
and the bench end to end on a tiny random-weight model. Speed is not checked beyond the proxy
never being faster than its link (a lower bound on time, which a loaded machine only raises)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from tools.throttle_proxy import Link, ThrottleProxy

ROOT = Path(__file__).resolve().parents[2]


def test_the_link_queues_each_chunk_behind_the_ones_before_it() -> None:
    link = Link(bytes_per_s=1e6)
    first = link.reserve(500_000)
    second = link.reserve(500_000)
    # 0.5 s for the first chunk, then 0.5 s more for the second, which waits behind it (less
    # the microseconds between the two calls).
    assert 0.49 < first <= 0.5 and 0.99 < second <= 1.0


def test_bytes_pass_the_proxy_unchanged_and_no_faster_than_its_link(valkey) -> None:
    host, port = valkey.url.removeprefix("valkey://").rsplit(":", 1)
    value = os.urandom(1_500_000)
    with ThrottleProxy(host, int(port), mbit=8) as proxy:      # 1 MB/s each way
        client = redis.Redis(port=proxy.port, socket_timeout=30)
        t0 = time.monotonic()
        client.set(b"tkv-proxy-test", value)
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        got = client.get(b"tkv-proxy-test")
        get_s = time.monotonic() - t0
        client.delete(b"tkv-proxy-test")
        client.close()
    assert got == value
    # 1.5 MB over a 1 MB/s link: at least ~1.5 s each way (the first 64 KiB chunk may leave at once).
    assert put_s >= 1.3 and get_s >= 1.3, (put_s, get_s)


def test_the_proxy_stops_when_its_parent_goes(valkey) -> None:
    host, port = valkey.url.removeprefix("valkey://").rsplit(":", 1)
    proxy = ThrottleProxy(host, int(port), mbit=100).start()
    proc = proxy._proc
    proc.stdin.close()              # what the parent's death looks like to the child
    assert proc.wait(timeout=30) == 0
    proxy._proc = None


def test_restore_policy_mode_reports_every_source_policy_and_split(tmp_path, tiny_model_dir) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ttft.py"), "--restore-policy", "auto,load,recompute",
                          "--model", str(tiny_model_dir), "--prefix-lengths", "32,64", "--repeat", "1",
                          "--remote-mbit", "50", "--json"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mode"] == "restore_policy" and res["policies"] == ["load", "recompute", "auto"]
    assert res["remote_mbit"] == [50.0] and set(res["cost_model"]) == {"direct", "remote@50Mbit"}
    by = {(c["source"], c["prefix_tokens"], c["policy"]): c for c in res["cases"]}
    sources = {"host", "disk", "remote", "remote@50Mbit"}
    assert {s for s, _, _ in by} == sources
    for source in sources:
        for n in (32, 64):
            assert {p for s, m, p in by if (s, m) == (source, n)} == {"miss", "device", "load", "recompute", "auto"}
            # The bench checked each hit came from its tier; the engine says how much it recomputed.
            assert by[(source, n, "load")]["recomputed_hit_tokens"] == 0
            assert by[(source, n, "recompute")]["recomputed_hit_tokens"] == n
            auto = by[(source, n, "auto")]
            assert [s["recomputed_tokens"] + s["loaded_tokens"] for s in auto["split"]] == [n]
            assert auto["split"][0]["recomputed_tokens"] == auto["recomputed_hit_tokens"]
            assert auto["pick_target_met"] == (auto["ttft_s"] <= 1.05 * min(by[(source, n, p)]["ttft_s"]
                                                                         for p in ("load", "recompute")))
    # The throttled source's own engine learned its link's rate from its fills.
    assert res["cost_model"]["remote@50Mbit"]["restore_bytes_per_s"]["remote"]["samples"] > 0
