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


def test_restore_policy_mode_reports_every_source_policy_split_and_first_hit(tmp_path, tiny_model_dir) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ttft.py"), "--restore-policy", "auto,load,recompute",
                          "--model", str(tiny_model_dir), "--prefix-lengths", "32,64", "--repeat", "1",
                          "--remote-mbit", "50", "--remote-timeout", "1", "--json",
                          # The tiny model's prompts need a few pages: 1 GiB pools per engine (the
                          # default) would hold ~2 GiB a site and crowd a CI machine.
                          "--device-memory", "64MiB", "--host-memory", "64MiB",
                          # A busy CI machine may take longer than the tiny model's recompute to
                          # read a block: patient deadlines, so each hit comes whole from its tier.
                          "--load-deadline-slack", "60"],
                         capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mode"] == "restore_policy" and res["policies"] == ["load", "recompute", "auto"]
    assert res["remote_mbit"] == [50.0] and set(res["cost_model"]) == {"local", "remote", "remote@50Mbit", "stalled"}
    by = {(r["source"], r["kind"], r["prefix_tokens"]): r for r in res["rows"]}
    sources = {"host", "disk", "remote", "remote@50Mbit", "stalled"}
    assert set(by) == {(s, k, n) for s in sources for k in ("steady", "first") for n in (32, 64)}
    for source in sources:
        for n in (32, 64):
            row, first = by[(source, "steady", n)], by[(source, "first", n)]
            assert set(row["ttft_s"]) == {"miss", "device", "load", "recompute", "auto"}
            assert set(first["ttft_s"]) == {"miss", "auto"}
            target = 1.2 if source == "stalled" else 1.1
            for r in (row, first):
                hit = r["targets"]["hit"]
                assert hit["target"] == target and hit["met"] == (r["ttft_s"]["auto"] <= target * r["ttft_s"]["miss"])
            pick = row["targets"]["pick"]
            best = min(row["ttft_s"]["load"], row["ttft_s"]["recompute"])
            # (a) is judged only where auto decided otherwise than the faster forced policy.
            assert pick["judged"] == (pick["auto_decisions"] != [pick["faster"]])
            assert pick["met"] == (row["ttft_s"]["auto"] <= 1.05 * best if pick["judged"] else None)
            assert row["targets"]["split"]["judged"] is False         # (b): from 1024 tokens
            if source == "stalled":
                continue           # whatever the store's timeout left of the hit
            # The bench checked each hit came from its tier; the engine says how much it recomputed.
            assert row["recomputed_hit_tokens"]["load"] == 0 and row["recomputed_hit_tokens"]["recompute"] == n
            assert [s["recomputed_tokens"] + s["loaded_tokens"] for s in row["auto_split"]] == [n]
            # The first request of a restarted engine hit the whole prefix in its source.
            assert first["hit_tokens"]["auto"] == [n]
    # The throttled source's own engine learned its link's rate from its fills; the restarted
    # engines' figures before their first hit are reported beside them.
    assert res["cost_model"]["remote@50Mbit"]["restore_bytes_per_s"]["remote"]["samples"] > 0
    assert set(res["first_cost_model"]) == sources
    assert set(res["summary"]) == {"hit", "pick", "split"} and res["summary"]["split"]["all_met"] is None
