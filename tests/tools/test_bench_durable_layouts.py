"""tools/bench_durable_layouts.py runs as a user would run it (a few blocks, two rounds, JSON) and
reports every layout with a positive rate, its paired ratio to chunk_files (1.0 for chunk_files
itself, every round), and leaves nothing behind in its temporary directory. Speed is not checked
here (docs/BENCHMARKS.md has the figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"lmdb_fresh", "lmdb_reused", "segments_batch", "segments_deep", "chunk_files"}


def test_every_layout_is_timed_and_cleaned_up(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_durable_layouts.py"), "--blocks", "5",
                          "--threads", "2", "--rounds", "2", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res["gbps"]) == LAYOUTS and all(v > 0 for v in res["gbps"].values())
    assert set(res["x_chunk_files"]) == LAYOUTS and res["x_chunk_files"]["chunk_files"] == 1.0
    assert all(len(r) == 2 for r in res["x_chunk_files_rounds"].values())
    assert res["config"] == {"blocks": 5, "block_bytes": 30 * 2 * 16 * 3 * 64 * 2, "threads": 2, "rounds": 2,
                             "batch": 32, "chunk_blocks": 16}
    assert list(tmp_path.iterdir()) == []      # every layout's files removed
