"""The billing ledger: per-tenant token counts and cost by token origin, durable in LMDB.

Knows: a finished request's usage validated and priced (prices and their arithmetic:
engine/billing_prices.py), and how it is stored -- one LMDB environment in its own directory
with three tables:
  requests  request_id -> the request's record (tenant, day, tokens, cost): the idempotency
            key and the audit trail (`check()` recomputes every sum from these records)
  totals    tenant -> running totals since the ledger was created
  days      tenant NUL YYYY-MM-DD (UTC) -> that day's totals
A writable open first commits the bills an earlier process left beside the ledger (the
reserve's journal and spill files: engine/billing_spill.py), and raises when it cannot (a full,
read-only or unwritable directory: the billing writer then runs without a ledger).
Doesn't know: engines, storage tiers or HTTP (dependencies point the other way); tier names
are the project's one vocabulary (storage/tier_kinds.py's TIERS: "device", "host", "disk", "remote").
A record written before a tier was known reads 0 tokens from it.

Money is never a float. A price p is micro-dollars per 1M tokens, so one token costs
p * 1e-6 micro-dollars = p pico-dollars: the cost of n tokens is exactly n * p pico-dollars,
an integer. Every stored cost is in pico-dollars and sums are exact (a request's cache-write
surcharge and retention are rounded to whole pico-dollars once: engine/billing_prices.py);
the other rounding is to whole micro-dollars for display (`TenantBill.cost`), once on the exact
sum. Rounding each request would lose up to half a micro-dollar per request (3 tokens at
27_000/1M are 0.081 micro-dollars: 0 when rounded, every time); rounding the sum loses under
half a micro-dollar in total, however many requests there are.
Records also keep the prompt tokens written under each retention class (`cache_write_tokens`)
and the token-seconds of retention bought, only when non-zero: a record without them (any
record made before they existed) reads as zeros.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator

import lmdb

from engine.billing_prices import Prices
from engine.billing_spill import RESERVE_FILE, forget_pending, read_pending
from engine.outputs import RETENTION_CLASSES
from storage.tier_kinds import TIERS
from storage.disk.environment import reserve_lock_file

log = logging.getLogger("tieredkv.billing")

PICO_PER_MICRO = 10**6
PICO_PER_USD = 10**12
_MAX_KEY_BYTES = 400          # LMDB keys are at most 511 bytes; leave room for the day suffix
_DEFAULT_MAP_SIZE = 4 << 30   # a sparse file: the address space, not the disk used


@dataclass(slots=True)
class Bucket:
    """Sums over a set of requests: one tenant's totals, or one tenant's day."""
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    miss_tokens: int = 0
    cost_pico: int = 0        # exact: pico-dollars (see the module docstring)
    # Of the miss tokens, those written under each retention class; tokens x seconds retained.
    cache_write_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RETENTION_CLASSES, 0))
    retained_token_seconds: int = 0

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())

    @property
    def cost(self) -> int:
        """Whole micro-dollars, rounded half up once on the exact sum."""
        return (self.cost_pico + PICO_PER_MICRO // 2) // PICO_PER_MICRO

    @property
    def cost_usd(self) -> float:
        """For display only; never add these up."""
        return self.cost_pico / PICO_PER_USD

    def add(self, other: "Bucket") -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        for t in TIERS:
            self.hit_tokens_by_tier[t] = self.hit_tokens_by_tier.get(t, 0) + other.hit_tokens_by_tier.get(t, 0)
        self.miss_tokens += other.miss_tokens
        self.cost_pico += other.cost_pico
        for c in RETENTION_CLASSES:
            self.cache_write_tokens[c] += other.cache_write_tokens[c]
        self.retained_token_seconds += other.retained_token_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
            "miss_tokens": self.miss_tokens,
            "cache_write_tokens": dict(self.cache_write_tokens),
            "retained_token_seconds": self.retained_token_seconds,
            "retained_token_hours": self.retained_token_seconds / 3600,     # display; seconds are exact
            "cost_pico": self.cost_pico,
            "cost": self.cost,
            "cost_usd": self.cost_usd,
        }

    def _stored(self) -> dict[str, Any]:
        """What is stored: the sums only (cost exact in pico-dollars; the rest is derived). The
        retention sums only when non-zero (the module docstring)."""
        d = {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
             "completion_tokens": self.completion_tokens, "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
             "miss_tokens": self.miss_tokens, "cost_pico": self.cost_pico}
        if any(self.cache_write_tokens.values()):
            d["cache_write_tokens"] = dict(self.cache_write_tokens)
        if self.retained_token_seconds:
            d["retained_token_seconds"] = self.retained_token_seconds
        return d

    def _encode(self) -> bytes:
        return json.dumps(self._stored(), separators=(",", ":")).encode()

    @classmethod
    def _decode(cls, raw: bytes | None) -> "Bucket":
        if raw is None:
            return cls()
        d = json.loads(raw)
        writes = d.get("cache_write_tokens", {})        # absent from older records: none
        return cls(d["requests"], d["prompt_tokens"], d["completion_tokens"],
                   {t: d["hit_tokens_by_tier"].get(t, 0) for t in TIERS}, d["miss_tokens"], d["cost_pico"],
                   {c: writes.get(c, 0) for c in RETENTION_CLASSES}, d.get("retained_token_seconds", 0))


@dataclass(slots=True)
class TenantBill(Bucket):
    """A tenant's running totals, plus one bucket per UTC day ("YYYY-MM-DD")."""
    tenant: str = ""
    days: dict[str, Bucket] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = Bucket.to_dict(self)
        return {"tenant": self.tenant, **d, "days": {k: v.to_dict() for k, v in sorted(self.days.items())}}


def _check_name(value: Any, name: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    if "\x00" in value:
        raise ValueError(f"{name}: must not contain NUL characters")
    raw = value.encode()
    if len(raw) > _MAX_KEY_BYTES:
        raise ValueError(f"{name}: at most {_MAX_KEY_BYTES} bytes of UTF-8, got {len(raw)}")
    return raw


def validate_tenant(tenant: Any) -> str:
    """The ledger's rule for tenant names (non-empty, no NUL, at most 400 UTF-8 bytes), for
    callers that must refuse a name before work is done for it, not when it is billed."""
    _check_name(tenant, "tenant")
    return tenant


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def _check_writes(value: Any, miss_tokens: int) -> dict[str, int]:
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"cache_write_tokens: expected a dict of retention class -> tokens, got {value!r}")
    unknown = sorted(set(value) - set(RETENTION_CLASSES), key=str)
    if unknown:
        raise ValueError(f"cache_write_tokens: unknown retention class {unknown[0]!r} (expected {RETENTION_CLASSES})")
    writes = {c: _check_count(value.get(c, 0), f"cache_write_tokens[{c!r}]") for c in RETENTION_CLASSES}
    if sum(writes.values()) > miss_tokens:
        raise ValueError(f"cache_write_tokens: {sum(writes.values())} written > miss_tokens {miss_tokens} "
                         "(a token written into the cache is one the request computed)")
    return writes


def _utc_day(when: datetime | None) -> str:
    if when is None:
        when = datetime.now(timezone.utc)
    elif not isinstance(when, datetime):
        raise ValueError(f"when: expected a datetime or None, got {when!r}")
    elif when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)    # a naive time is taken to be UTC already
    return when.astimezone(timezone.utc).date().isoformat()


@dataclass(frozen=True, slots=True)
class Entry:
    """One request's usage, validated and priced, ready to be written (Ledger.prepare)."""
    request_key: bytes
    tenant_key: bytes
    day_key: bytes
    record: bytes
    bucket: "Bucket"

    @classmethod
    def of(cls, request_key: bytes, tenant: str, day: str, record: bytes, bucket: "Bucket") -> "Entry":
        """An entry's keys follow from its tenant and UTC day (the `days` table's key)."""
        tenant_key = tenant.encode()
        return cls(request_key, tenant_key, tenant_key + b"\x00" + day.encode(), record, bucket)


def prepare(prices: Prices, tenant: str, request_id: str, prompt_tokens: int, completion_tokens: int,
            hit_tokens_by_tier: dict[str, int], miss_tokens: int, when: datetime | None = None,
            cache_write_tokens: dict[str, int] | None = None, retained_token_seconds: int = 0) -> Entry:
    """Validate and price one request's usage (ValueError naming the field); nothing is written.
    Needs no ledger: a request is priced even while the ledger cannot be opened.
    `cache_write_tokens`: of the miss tokens, those written under each retention class."""
    _check_name(tenant, "tenant")          # Entry.of makes the key from it
    rid_key = _check_name(request_id, "request_id")
    _check_count(prompt_tokens, "prompt_tokens")
    _check_count(completion_tokens, "completion_tokens")
    _check_count(miss_tokens, "miss_tokens")
    if not isinstance(hit_tokens_by_tier, dict):
        raise ValueError(f"hit_tokens_by_tier: expected a dict of tier -> tokens, got {hit_tokens_by_tier!r}")
    unknown = sorted(set(hit_tokens_by_tier) - set(TIERS))
    if unknown:
        raise ValueError(f"hit_tokens_by_tier: unknown tier {unknown[0]!r} (expected {TIERS})")
    hits = {t: _check_count(hit_tokens_by_tier.get(t, 0), f"hit_tokens_by_tier[{t!r}]") for t in TIERS}
    # NOTE invariant: every prompt token is billed exactly once, by its origin.
    if sum(hits.values()) + miss_tokens != prompt_tokens:
        raise ValueError(f"hit_tokens_by_tier + miss_tokens: hit {sum(hits.values())} + miss {miss_tokens} "
                         f"!= prompt_tokens {prompt_tokens}")
    writes = _check_writes(cache_write_tokens, miss_tokens)
    _check_count(retained_token_seconds, "retained_token_seconds")
    day = _utc_day(when)
    cost = prices.cost_pico(hits, miss_tokens, completion_tokens, writes, retained_token_seconds)
    one = Bucket(1, prompt_tokens, completion_tokens, hits, miss_tokens, cost, writes, retained_token_seconds)
    record = json.dumps({"tenant": tenant, "day": day, **one._stored()}, separators=(",", ":")).encode()
    return Entry.of(rid_key, tenant, day, record, one)


def entry_of(request_id: bytes, record: bytes) -> Entry:
    """An entry again from its record, as the reserve's journal and spill files keep it."""
    rec = json.loads(record)
    return Entry.of(request_id, rec["tenant"], rec["day"], record, Bucket._decode(record))


def uncommitted(ledger: "Ledger", tenant: str | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Bills that wait beside a ledger (the reserve's journal, spill files) and are not in it yet,
    summed per tenant, and where they wait: what `tieredkv billing --cache-dir` adds for a stopped
    server (the next open commits them)."""
    rows, files = read_pending(ledger.path)
    waiting: dict[str, Bucket] = {}
    for rid, record in rows:
        e = entry_of(rid, record)
        if not ledger.has(rid.decode()) and (tenant is None or e.tenant_key.decode() == tenant):
            waiting.setdefault(e.tenant_key.decode(), Bucket()).add(e.bucket)
    reserve = os.path.join(ledger.path, RESERVE_FILE)
    where = ([reserve] if waiting and os.path.exists(reserve) else []) + (files if waiting else [])
    return {t: b.to_dict() for t, b in waiting.items()}, where


class Ledger:
    """Per-tenant billing in an LMDB environment at `path` (a directory of its own).

    Thread-safe: writes take a lock and one LMDB write transaction each; reads use their own
    read transactions. `readonly=True` opens a ledger that a running server writes (LMDB
    readers never block the writer and see only committed transactions).
    """

    def __init__(self, path: str | os.PathLike, prices: Prices = Prices(), readonly: bool = False,
                 map_size: int = _DEFAULT_MAP_SIZE) -> None:
        if not isinstance(prices, Prices):
            raise ValueError(f"prices: expected a Prices, got {prices!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.prices = prices
        self.readonly = readonly
        if readonly:
            if not os.path.exists(os.path.join(self.path, "data.mdb")):
                raise FileNotFoundError(f"no billing ledger at {self.path}")
        else:
            os.makedirs(self.path, exist_ok=True)
        if not readonly:
            # NOTE: before LMDB maps lock.mdb (a full filesystem would make that a SIGBUS).
            # DiskUnavailable when it cannot be had: the billing writer then runs without a ledger.
            reserve_lock_file(self.path)
        # NOTE durability: LMDB's defaults (sync=True, metasync=True) are kept on purpose: a
        # record() that returned has been fsync'ed, so a crash never loses a billed request.
        self._env = lmdb.open(self.path, map_size=map_size, max_dbs=4, readonly=readonly,
                              subdir=True, lock=True)
        try:
            create = not readonly
            self._requests = self._env.open_db(b"requests", create=create)
            self._totals = self._env.open_db(b"totals", create=create)
            self._days = self._env.open_db(b"days", create=create)
        except lmdb.Error:
            self._env.close()
            raise
        self._write_lock = threading.Lock()
        if not readonly:
            try:
                self._commit_pending()
            except BaseException:
                self._env.close()
                raise

    def _commit_pending(self) -> None:
        """Commit the bills an earlier process left beside the ledger (the reserve's journal,
        spill files: engine/billing_spill.py), then forget them. Raises when they cannot be
        committed (they stay where they are, for the next open)."""
        rows, files = read_pending(self.path)
        if rows:
            done = self.record_many([entry_of(rid, record) for rid, record in rows])
            log.warning("billing: %d bills an earlier process could not commit are in the ledger now (%d were "
                        "already)", sum(done), len(done) - sum(done))
        if rows or files:
            forget_pending(self.path, files)

    # -- writing ---------------------------------------------------------------------------

    def record(self, tenant: str, request_id: str, prompt_tokens: int, completion_tokens: int,
               hit_tokens_by_tier: dict[str, int], miss_tokens: int, when: datetime | None = None,
               cache_write_tokens: dict[str, int] | None = None, retained_token_seconds: int = 0) -> bool:
        """Bill one finished request. Returns False (and changes nothing) if `request_id` was
        already recorded. Durable when it returns: the caller may then complete the response."""
        return self.record_many([self.prepare(tenant, request_id, prompt_tokens, completion_tokens,
                                              hit_tokens_by_tier, miss_tokens, when, cache_write_tokens,
                                              retained_token_seconds)])[0]

    def prepare(self, tenant: str, request_id: str, prompt_tokens: int, completion_tokens: int,
                hit_tokens_by_tier: dict[str, int], miss_tokens: int, when: datetime | None = None,
                cache_write_tokens: dict[str, int] | None = None, retained_token_seconds: int = 0) -> "Entry":
        """Validate and price one request's usage (ValueError naming the field); nothing is written."""
        if self.readonly:
            raise PermissionError(f"ledger at {self.path} was opened read-only")
        return prepare(self.prices, tenant, request_id, prompt_tokens, completion_tokens, hit_tokens_by_tier,
                       miss_tokens, when, cache_write_tokens, retained_token_seconds)

    def record_many(self, entries: list["Entry"]) -> list[bool]:
        """Bill several prepared requests in one write transaction: one fsync for all of them
        (group commit). Per entry, False if its request id was already recorded. Durable when
        it returns, or nothing of it is: the transaction commits whole or not at all."""
        if self.readonly:
            raise PermissionError(f"ledger at {self.path} was opened read-only")
        done = []
        with self._write_lock, self._env.begin(write=True) as txn:
            for e in entries:
                # NOTE idempotency: the request id, the totals and the day bucket change in one
                # transaction, so a request is counted in all of them or in none, exactly once.
                if not txn.put(e.request_key, e.record, db=self._requests, overwrite=False):
                    done.append(False)
                    continue
                for db, key in ((self._totals, e.tenant_key), (self._days, e.day_key)):
                    b = Bucket._decode(txn.get(key, db=db))
                    b.add(e.bucket)
                    txn.put(key, b._encode(), db=db)
                done.append(True)
        return done

    # -- reading ---------------------------------------------------------------------------

    def has(self, request_id: str) -> bool:
        with self._env.begin() as txn:
            return txn.get(_check_name(request_id, "request_id"), db=self._requests) is not None

    def tenants(self) -> list[str]:
        with self._env.begin() as txn:
            return [k.decode() for k in txn.cursor(db=self._totals).iternext(keys=True, values=False)]

    def tenant(self, name: str) -> TenantBill:
        """The tenant's bill; a tenant never billed gets an empty one."""
        key = _check_name(name, "tenant")
        with self._env.begin() as txn:
            return self._bill(txn, name, key)

    def summary(self) -> dict[str, Any]:
        """Every tenant's bill and the grand total, as JSON-ready dicts (one consistent snapshot)."""
        with self._env.begin() as txn:
            bills = [self._bill(txn, k.decode(), bytes(k))
                     for k in txn.cursor(db=self._totals).iternext(keys=True, values=False)]
        total = Bucket()
        for b in bills:
            total.add(b)
        return {"prices": self.prices.to_dict(), "total": total.to_dict(),
                "tenants": {b.tenant: b.to_dict() for b in bills}}

    def records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every recorded request: (request_id, its record). A snapshot, for audits."""
        with self._env.begin() as txn:
            items = [(k.decode(), json.loads(v)) for k, v in txn.cursor(db=self._requests)]
        return iter(items)

    def check(self) -> None:
        """Integrity audit: every total and day bucket equals the sum of its request records,
        and every record keeps hit + miss == prompt and written <= miss. Raises AssertionError on a mismatch."""
        with self._env.begin() as txn:
            want_totals: dict[str, Bucket] = {}
            want_days: dict[tuple[str, str], Bucket] = {}
            for rid, raw in txn.cursor(db=self._requests):
                r = json.loads(raw)
                one = Bucket._decode(raw)
                assert one.hit_tokens + one.miss_tokens == one.prompt_tokens, f"request {rid!r}: hit + miss != prompt"
                assert sum(one.cache_write_tokens.values()) <= one.miss_tokens, f"request {rid!r}: written > miss"
                want_totals.setdefault(r["tenant"], Bucket()).add(one)
                want_days.setdefault((r["tenant"], r["day"]), Bucket()).add(one)
            got_totals = {k.decode(): Bucket._decode(v) for k, v in txn.cursor(db=self._totals)}
            got_days = {tuple(k.decode().split("\x00")): Bucket._decode(v) for k, v in txn.cursor(db=self._days)}
        assert got_totals == want_totals, f"tenant totals differ from request records: {got_totals} != {want_totals}"
        assert got_days == want_days, f"day buckets differ from request records: {got_days} != {want_days}"

    def _bill(self, txn: lmdb.Transaction, name: str, key: bytes) -> TenantBill:
        b = Bucket._decode(txn.get(key, db=self._totals))
        days = {}
        prefix = key + b"\x00"
        cur = txn.cursor(db=self._days)
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                days[k[len(prefix):].decode()] = Bucket._decode(v)
        return TenantBill(b.requests, b.prompt_tokens, b.completion_tokens, b.hit_tokens_by_tier,
                          b.miss_tokens, b.cost_pico, b.cache_write_tokens, b.retained_token_seconds,
                          tenant=name, days=days)

    def probe(self) -> None:
        """One real write (a page changed, committed, fsynced) that bills nothing: whether the
        ledger takes writes now. Raises as a commit of a bill would. (Its own database: every sum
        and `check()` read only the three tables above.)"""
        with self._write_lock, self._env.begin(write=True) as txn:
            db = self._env.open_db(b"probe", txn=txn)
            txn.put(b"last", datetime.now(timezone.utc).isoformat().encode(), db=db)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.path!r}, readonly={self.readonly})"

