"""tools/live_drill.py is runnable as a user runs it: its three files import and --help names every
row. The drill itself starts real servers for minutes (docs/BENCHMARKS.md, "Live attacks on a
serving process"): not run here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_help_names_every_row() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "live_drill.py"), "--help"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("control", "truncate", "garbage", "zero_meta", "unlink", "read_only", "disconnect", "tenant_flood",
                "full_fs_bills", "tiny_disk_flush"):
        assert row in out.stdout, row
