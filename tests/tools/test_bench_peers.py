"""tools/bench_peers.py runs and reports every field: its quick mode (random blocks, one round,
no LMCache) end to end against a real valkey-server, as a user would run it. Speed is not
checked here (docs/BENCHMARKS.md has the figures); nothing is installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_reports_every_field(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_peers.py"), "--synthetic", "--blocks", "4",
                          "--rounds", "1", "--no-peer", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])

    assert res["peer"]["available"] is False and res["peer"]["reason"] == "--no-peer"
    assert set(res["peer"]["gbps"]) == {"disk_put", "disk_put_fsync", "disk_get", "remote_put", "remote_get"}
    assert all(v is None for v in res["peer"]["gbps"].values())
    cfg = res["config"]
    assert cfg["blocks"] == 4 and cfg["rounds"] == 1 and cfg["dtype"] == "bfloat16"
    assert cfg["block_shape"] == [30, 2, 16, 3, 64] and cfg["remote"] == "valkey-server on loopback"
    assert set(res["edges"]) == set(cfg["codecs"]) and "zstd" in cfg["codecs"]
    for kind, rows in res["edges"].items():
        assert set(rows) == {"disk_put", "disk_get", "remote_put", "remote_get"}, kind
        for edge, row in rows.items():
            assert row["gbps"] > 0 and row["limit_gbps"] > 0, (kind, edge)
            assert row["x_limit_best"] == round(row["gbps"] / row["limit_gbps"], 3)
            assert len(row["x_limit_paired"]) == 3 and row["x_limit"] == row["x_limit_paired"][1]
            assert row["x_peer"] is None and row["x_peer_paired"] is None and row["x_peer_best"] is None
            assert all(v is None or v > 0 for v in row["limit_parts_gbps"].values())
        assert cfg["ratio"][kind] > 0
    names = [t["name"] for t in res["targets"]]
    assert [n for n in names if n.startswith("zstd")] == [f"zstd {e} >= 0.8 of its limit"
                                                         for e in ("disk_put", "disk_get", "remote_put", "remote_get")]
    for t in res["targets"]:
        if t["name"].startswith("zstd"):
            assert t["met"] == (t["value"] >= 0.8)
        else:
            assert t["met"] is None          # a raw-codec target needs the peer (or the raw codec)
    assert "CPU threads" in res["machine"]
    assert not list(tmp_path.glob("tieredkv-lmcache-*"))       # --no-peer built no venv
