"""`tieredkv billing --cache-dir` on a stopped server (issue 44 item 5): bills that wait beside the
ledger -- in the reserve's journal or a spill file, committed by the next start -- are counted
apart, per tenant, with where they wait; a bill already in the ledger is not counted twice."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.billing import Ledger, Prices, prepare
from engine.billing_spill import write_spill_file


REPO = Path(__file__).resolve().parents[1]


def tkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)})


def test_bills_waiting_beside_a_stopped_servers_ledger_are_counted_apart(tmp_path: Path) -> None:
    path = tmp_path / "billing"
    tiers = {"device": 0, "host": 0, "disk": 0, "remote": 0}
    with Ledger(path) as ledger:
        assert ledger.record("alice", "r1", 10, 2, {**tiers, "device": 4}, 6)
    done = prepare(Prices(), "alice", "r1", 10, 2, {**tiers, "device": 4}, 6)       # committed already
    bob = prepare(Prices(), "bob", "r2", 32, 5, {**tiers, "disk": 16}, 16)
    carol = prepare(Prices(), "carol", "r3", 8, 1, tiers, 8)
    spilled = write_spill_file(str(path), [(e.request_key, e.record) for e in (done, bob, carol)])
    r = tkv("billing", "--cache-dir", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["total"]["requests"] == 1                          # the ledger as committed
    waiting = body["uncommitted"]
    assert set(waiting["tenants"]) == {"bob", "carol"} and waiting["where"] == [spilled]
    assert waiting["tenants"]["bob"]["requests"] == 1 and waiting["tenants"]["bob"]["prompt_tokens"] == 32
    assert waiting["tenants"]["bob"]["hit_tokens_by_tier"]["disk"] == 16
    r = tkv("billing", "--cache-dir", str(tmp_path), "--tenant", "bob", "--json")
    assert set(json.loads(r.stdout)["uncommitted"]["tenants"]) == {"bob"}
    r = tkv("billing", "--cache-dir", str(tmp_path))
    assert r.returncode == 0 and "plus 2 bills of bob, carol not in the ledger yet" in " ".join(r.stdout.split())
    with Ledger(path) as ledger:                                    # the next start commits them
        assert ledger.has("r2") and ledger.has("r3")
    body = json.loads(tkv("billing", "--cache-dir", str(tmp_path), "--json").stdout)
    assert body["total"]["requests"] == 3 and body["uncommitted"] == {"tenants": {}, "where": []}
