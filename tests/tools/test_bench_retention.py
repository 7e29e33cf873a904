"""tools/bench_retention.py in its quick mode (the tiny Llama shape, a real engine with a real LMDB
disk tier under tmp_path), run as a user runs it: its JSON carries every row beside its peer, the
flood's working set is at least 5x the blocks the cache held, and every retained prompt is a
whole hit after the flood (retained hit rate 1.0) while the flood's own prompts are not all
hits. Speed is not checked here (docs/BENCHMARKS.md has the figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_keeps_every_retained_prompt_through_a_flood_5x_the_cache(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_retention.py"), "--quick", "--json"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])

    assert set(res) == {"config", "flood", "bookkeeping", "rows", "machine"}
    f, b = res["flood"], res["bookkeeping"]
    assert res["config"]["model"].startswith("random-shape:tiny-llama") and res["config"]["retained"] == 2
    assert f["working_set_x_cache"] >= 5.0
    assert f["flood_after_last_retained_x_cache"] >= 4.0      # LRU alone would have dropped them
    assert f["hit_rate"]["retained"] == 1.0 and f["refused_tokens"] == 0
    assert f["hit_rate"]["unretained"] < 1.0
    assert sorted(f["retained_classes"]) == ["1h", "24h"]
    full = res["config"]["prompt_blocks"] * res["config"]["block_size"]
    assert [sum(w.values()) for w in f["retained_first_writes"]] == [res["config"]["prompt_tokens"]] * 2
    assert sum(f["hit_rate"]["retained_by_tier"].values()) >= 2 * full
    assert f["retention"]["enabled"] and f["retention"]["blocks"] >= 2 * res["config"]["prompt_blocks"]
    assert all(v > 0 for v in f["ttft_s"].values())
    for kind in ("repeat", "new_suffix"):
        t = b[kind]
        assert t["with_retain_s"] > 0 and t["without_s"] > 0
        assert t["overhead"] > -1
        assert t["overhead_best"] == round(t["best_with_retain_s"] / t["best_without_s"] - 1, 4)
    assert b["retain_call_us"] > 0 and b["target"] == 0.05
    rows = {r["row"]: r for r in res["rows"]}
    assert list(rows) == ["retained hit rate", "unretained hit rate (LRU)", "retained re-request TTFT",
                          "unretained re-request TTFT", "hit, same prompt + retain", "hit, new suffix + retain",
                          "retain() call"]
    assert rows["retained hit rate"]["ok"] is True
    assert rows["retained re-request TTFT"]["beside"] == f["ttft_s"]["recompute"]
