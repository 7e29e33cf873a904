"""Issue 39 item 4: the ledger records cache writes by retention class and retained token-seconds,
prices them exactly (write multipliers of the miss price, a price per retained token-hour), reads
a ledger written before they existed, and shows them (`tieredkv billing`, table and --json).
Real LMDB ledgers in tmp_path, the real CLI in a child process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import lmdb
import pytest

from engine.billing import Ledger, Prices, entry_of
from engine.billing_writer import BillingWriter
from tests.engine.test_billing_full_disk import submit_and_wait

REPO = Path(__file__).resolve().parents[2]
DAY = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
NO_HITS = {"device": 0, "host": 0, "disk": 0, "remote": 0}


def tkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)})


# -- prices ----------------------------------------------------------------------------------

def test_write_multipliers_default_to_anthropics_and_storage_is_free():
    p = Prices()
    assert (p.cache_write_5m, p.cache_write_1h, p.cache_write_24h, p.retained_token_hour) == (1.25, 2.0, 1.0, 0)
    assert [p.write_multiplier_e4(c) for c in ("5m", "1h", "24h")] == [12_500, 20_000, 10_000]


def test_multipliers_from_json_and_toml_are_exact_ten_thousandths(tmp_path):
    (tmp_path / "p.json").write_text('{"cache_write_5m": 1.1, "cache_write_1h": 3, "retained_token_hour": 4500000}')
    (tmp_path / "p.toml").write_text("cache_write_5m = 1.1\ncache_write_1h = 3\nretained_token_hour = 4_500_000\n")
    want = Prices(cache_write_5m=Decimal("1.1"), cache_write_1h=3, retained_token_hour=4_500_000)
    for name in ("p.json", "p.toml"):
        got = Prices.from_file(tmp_path / name)
        assert got == want and got.write_multiplier_e4("5m") == 11_000 and got.write_multiplier_e4("1h") == 30_000
    assert Prices(cache_write_24h=1.2345).write_multiplier_e4("24h") == 12_345
    assert json.loads(json.dumps(want.to_dict()))["cache_write_5m"] == 1.1


@pytest.mark.parametrize("field,value,match", [
    ("cache_write_5m", 1.00001, "at most 4 decimal places"),
    ("cache_write_1h", 0.5, "at least 1"),
    ("cache_write_24h", -2, "at least 1"),
    ("cache_write_5m", "1.25", "expected a number"),
    ("cache_write_1h", True, "expected a number"),
    ("cache_write_1h", float("inf"), "at most 4 decimal places"),
    ("retained_token_hour", 1.5, "per 1M token-hours"),
    ("retained_token_hour", -1, "per 1M token-hours"),
])
def test_bad_retention_prices_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"^{field}: .*{match}"):
        Prices(**{field: value})


def test_a_bad_multiplier_in_a_prices_file_names_it(tmp_path):
    (tmp_path / "p.toml").write_text("cache_write_1h = 2.00005\n")
    with pytest.raises(ValueError, match=r"^cache_write_1h: expected a number with at most 4 decimal places"):
        Prices.from_file(tmp_path / "p.toml")
    (tmp_path / "p.json").write_text('{"cache_write_2h": 2}')
    with pytest.raises(ValueError, match="^cache_write_2h: unknown price"):
        Prices.from_file(tmp_path / "p.json")


def test_serve_refuses_a_bad_multiplier_at_startup_before_loading_a_model(tmp_path):
    (tmp_path / "prices.json").write_text('{"cache_write_5m": 0.9}')
    r = tkv("serve", "--prices", str(tmp_path / "prices.json"), "--cache-dir", str(tmp_path / "cache"),
            "--model", str(tmp_path / "no-such-model"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --prices: " in r.stderr and "cache_write_5m: expected at least 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# -- cost ------------------------------------------------------------------------------------

def test_the_worked_example_costs_exactly(tmp_path):
    """1000 missed tokens, 600 written for an hour (2x) and 100 for 5 minutes (1.25x), at the
    default miss price of 270_000 micro-dollars per 1M tokens (270_000 pico-dollars a token)."""
    with Ledger(tmp_path / "billing", Prices(completion=0)) as led:
        assert led.record("acme", "r1", 1000, 0, NO_HITS, 1000, DAY, cache_write_tokens={"1h": 600, "5m": 100})
        bill = led.tenant("acme")
    # 300 computed at 270_000, 600 at 540_000, 100 at 337_500.
    assert bill.cost_pico == 300 * 270_000 + 600 * 540_000 + 100 * 337_500 == 438_750_000
    assert bill.cache_write_tokens == {"5m": 100, "1h": 600, "24h": 0}


def test_retention_and_fractions_are_rounded_once_per_request_half_up(tmp_path):
    # miss: 1 pico-dollar a token; retention: 1 micro-dollar per 1M token-hours, 1 pico a token-hour.
    prices = Prices(miss=1, device_hit=0, completion=0, retained_token_hour=1)
    with Ledger(tmp_path, prices) as led:
        led.record("t", "quarter", 1, 0, NO_HITS, 1, cache_write_tokens={"5m": 1})   # 1 + 0.25 pico -> 1
        led.record("t", "half", 2, 0, NO_HITS, 2, cache_write_tokens={"5m": 2})      # 2 + 0.5 pico -> 3
        led.record("t", "kept", 0, 0, NO_HITS, 0, retained_token_seconds=7200)       # 2 token-hours: 2 pico
        led.record("t", "both", 2, 0, NO_HITS, 2, cache_write_tokens={"5m": 1},      # 2 + 0.25 + 0.3 -> 3
                   retained_token_seconds=1080)                                      # (each rounded alone: 2)
        got = {rid: r["cost_pico"] for rid, r in led.records()}
        assert got == {"quarter": 1, "half": 3, "kept": 2, "both": 3}
        bill = led.tenant("t")
        assert bill.retained_token_seconds == 8280 and bill.to_dict()["retained_token_hours"] == 2.3
        led.check()
    # Gemini-like storage, $1 per 1M token-hours: 1M tokens kept an hour cost exactly $1.
    with Ledger(tmp_path / "gemini", Prices(retained_token_hour=1_000_000)) as led:
        led.record("t", "r", 0, 0, NO_HITS, 0, retained_token_seconds=1_000_000 * 3600)
        assert led.tenant("t").cost_pico == 10**12 and led.tenant("t").cost_usd == 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_write_tokens={"2h": 1}), r"^cache_write_tokens: unknown retention class '2h'"),
    (dict(cache_write_tokens={"1h": -1}), r"^cache_write_tokens\['1h'\]: expected a non-negative int"),
    (dict(cache_write_tokens={"1h": 1.0}), r"^cache_write_tokens\['1h'\]"),
    (dict(cache_write_tokens={"5m": 3, "1h": 3}), r"^cache_write_tokens: 6 written > miss_tokens 5"),
    (dict(cache_write_tokens=[("1h", 1)]), r"^cache_write_tokens: expected a dict"),
    (dict(retained_token_seconds=-1), r"^retained_token_seconds:"),
    (dict(retained_token_seconds=True), r"^retained_token_seconds:"),
])
def test_bad_retention_usage_is_refused_naming_the_field_and_changes_nothing(tmp_path, kwargs, match):
    with Ledger(tmp_path) as led:
        with pytest.raises(ValueError, match=match):
            led.record("acme", "r", 8, 1, {"device": 3}, 5, **kwargs)
        assert led.tenants() == [] and list(led.records()) == []


# -- sums, old records, the writer -----------------------------------------------------------

def test_writes_and_retention_sum_per_tenant_and_day_and_survive_the_journal(tmp_path):
    with Ledger(tmp_path / "billing") as led:
        led.record("acme", "a", 40, 0, {"device": 16}, 24, DAY, {"5m": 8, "1h": 16}, 16 * 300)
        led.record("acme", "b", 40, 0, {"device": 32}, 8, DAY, {"24h": 8}, 8 * 86400)
        led.record("acme", "c", 16, 0, NO_HITS, 16, DAY)
        bill = led.tenant("acme")
        assert bill.cache_write_tokens == {"5m": 8, "1h": 16, "24h": 8}
        assert bill.retained_token_seconds == 16 * 300 + 8 * 86400
        assert bill.days["2026-03-01"].cache_write_tokens == bill.cache_write_tokens
        summary = led.summary()
        assert summary["total"]["cache_write_tokens"] == {"5m": 8, "1h": 16, "24h": 8}
        assert summary["prices"]["cache_write_5m"] == 1.25 and json.loads(json.dumps(summary)) == summary
        records = dict(led.records())
        assert "cache_write_tokens" not in records["c"]        # a request without retention: today's shape
        raw = json.dumps(records["a"], separators=(",", ":")).encode()
        assert entry_of(b"a", raw).bucket.cache_write_tokens == {"5m": 8, "1h": 16, "24h": 0}   # a journal's line
        led.check()


def _old_bucket(requests: int, prompt: int, miss: int, cost: int) -> dict:
    """A record as the ledger wrote it before issue 39 (no cache writes, no retention)."""
    return {"requests": requests, "prompt_tokens": prompt, "completion_tokens": 0,
            "hit_tokens_by_tier": {"device": prompt - miss, "host": 0, "disk": 0, "remote": 0},
            "miss_tokens": miss, "cost_pico": cost}


def test_a_ledger_written_before_retention_reads_as_zeros_and_takes_new_bills(tmp_path):
    path = tmp_path / "billing"
    with Ledger(path):
        pass                                             # the environment and its three tables
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        enc = lambda d: json.dumps(d, separators=(",", ":")).encode()    # noqa: E731
        txn.put(b"old-1", enc({"tenant": "acme", "day": "2025-01-02", **_old_bucket(1, 10, 4, 1_188_000)}),
                db=env.open_db(b"requests", txn=txn))
        txn.put(b"acme", enc(_old_bucket(1, 10, 4, 1_188_000)), db=env.open_db(b"totals", txn=txn))
        txn.put(b"acme\x002025-01-02", enc(_old_bucket(1, 10, 4, 1_188_000)), db=env.open_db(b"days", txn=txn))
    env.close()
    with Ledger(path) as led:
        bill = led.tenant("acme")
        assert (bill.requests, bill.miss_tokens, bill.cost_pico) == (1, 4, 1_188_000)
        assert bill.cache_write_tokens == {"5m": 0, "1h": 0, "24h": 0} and bill.retained_token_seconds == 0
        assert bill.to_dict()["days"]["2025-01-02"]["retained_token_hours"] == 0
        led.check()
        assert led.record("acme", "new-1", 10, 0, NO_HITS, 10, DAY, {"1h": 10}, 36_000)
        bill = led.tenant("acme")
        assert bill.requests == 2 and bill.cache_write_tokens["1h"] == 10 and bill.retained_token_seconds == 36_000
        assert bill.cost_pico == 1_188_000 + 10 * 270_000 * 2
        led.check()


def test_the_billing_writer_passes_the_writes_through(tmp_path):
    ledger = Ledger(tmp_path / "billing", Prices(miss=100, completion=0))
    writer = BillingWriter(ledger, reserve_bytes=0)
    try:
        e = writer.prepare("acme", "r1", 20, 0, {"host": 4}, 16, cache_write_tokens={"24h": 16},
                           retained_token_seconds=16 * 86400)
        assert submit_and_wait(writer, e) == {"recorded": True, "error": None}
        bill = ledger.tenant("acme")
        assert bill.cache_write_tokens["24h"] == 16 and bill.retained_token_seconds == 16 * 86400
        assert bill.cost_pico == 4 * 27_000 + 16 * 100 * 1      # 24h: a write at the miss price (OpenAI's)
        with pytest.raises(ValueError, match="^cache_write_tokens: 17 written > miss_tokens 16"):
            writer.prepare("acme", "r2", 20, 0, {"host": 4}, 16, cache_write_tokens={"5m": 17})
    finally:
        writer.close()
        ledger.close()


# -- tieredkv billing ------------------------------------------------------------------------

def test_the_billing_command_shows_writes_by_class_and_retained_token_hours(tmp_path):
    with Ledger(tmp_path / "billing") as led:
        led.record("alice", "a1", 1000, 0, NO_HITS, 1000, DAY, {"5m": 100, "1h": 600}, 700 * 3600)
        led.record("bob", "b1", 50, 0, {"disk": 16}, 34, DAY, {"24h": 32}, 32 * 86400)
        led.record("carol", "c1", 10, 0, NO_HITS, 10, DAY)
    r = tkv("billing", "--cache-dir", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    alice = body["tenants"]["alice"]
    assert alice["cache_write_tokens"] == {"5m": 100, "1h": 600, "24h": 0}
    assert alice["retained_token_seconds"] == 2_520_000 and alice["retained_token_hours"] == 700
    assert body["total"]["cache_write_tokens"] == {"5m": 100, "1h": 600, "24h": 32}
    r = tkv("billing", "--cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if "Write 5m" in ln)
    assert "Write 1h" in lines[head] and "Write 24h" in lines[head] and "Retained tok·h" in lines[head]
    end = next(i for i, ln in enumerate(lines) if ln.startswith("total $"))
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[head + 1:end] if ln.split() and ln.split()[0] in
            ("alice", "bob", "carol", "total")}
    assert rows == {"alice": ["100", "600", "0", "700.00"], "bob": ["0", "0", "32", "768.00"],
                    "carol": ["0", "0", "0", "0.00"], "total": ["100", "600", "32", "1,468.00"]}
    r = tkv("billing", "--cache-dir", str(tmp_path), "--tenant", "carol")
    assert r.returncode == 0 and "Write 5m" not in r.stdout      # nothing retained: no retention table
