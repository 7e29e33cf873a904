"""Retention: prefixes a client paid to keep (issue 39, item 1). A retained block may move down the
tiers as any other, but the lowest local tier (the disk, or the host slab where there is no disk)
does not evict it before its deadline; a hit that asks again refreshes the deadline.

Knows: which blocks each tenant retains and until when (wall-clock seconds, from `clock`, so a
deadline means the same after a restart), the bounds (`max_bytes` over every tenant, below the
lowest local tier's capacity so unretained traffic always has room, and `per_tenant_bytes`), what
a request bought (blocks kept, refused, and seconds of retention added) and the rows the disk
keeps so that deadlines survive a restart (storage/disk/retained.py). A block retained by two
tenants counts against both tenants' bounds (each paid for it) and once against the global one.
Doesn't know: where a block is now, or how a tier skips it when evicting (storage/disk/room.py
asks the disk's rows; storage/host_tier.py asks `live`), billing (the engine turns an outcome
into usage), or HTTP.

Threads: any. One small lock guards the book; it is a leaf lock (nothing is called holding it),
so the engine thread may ask `live` while holding the tiers' lock.
"""
from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from storage.hashing import BlockKey

__all__ = ["RETENTION_SECONDS", "RetainOutcome", "RetainRow", "Retention", "TenantRetention", "retention_seconds"]

# Each class a client may buy and how long it keeps a prefix: Anthropic's cache_control ttl
# ("5m" default, "1h"), OpenAI's prompt_cache_retention "24h". engine/outputs.py names them too.
RETENTION_SECONDS = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}
WRITE_AHEAD = 0.02     # of a class's seconds: how far past a deadline the disk's row says (see retain)


def retention_seconds(klass: str) -> float:
    """The seconds a retention class keeps a prefix (ValueError naming the known ones)."""
    try:
        return RETENTION_SECONDS[klass]
    except KeyError:
        raise ValueError(f"retention: expected one of {sorted(RETENTION_SECONDS)}, got {klass!r}") from None


@dataclass(frozen=True, slots=True)
class RetainRow:
    """One tenant's retention of one block: what the disk keeps per block (storage/disk/retained.py)."""
    block_hash: bytes
    tenant: str
    deadline: float      # wall-clock seconds
    klass: str


@dataclass(frozen=True, slots=True)
class RetainOutcome:
    """What one request's ask bought: blocks kept (new or refreshed), blocks refused by a bound
    (the first refused and every block after it in the chain: a block without its parent is of no
    use), and the block-seconds of retention added (each deadline moved on)."""
    retained: int = 0
    refused: int = 0
    block_seconds: float = 0.0
    rows: tuple[RetainRow, ...] = ()     # the rows to persist (new deadlines)

    def __add__(self, other: "RetainOutcome") -> "RetainOutcome":
        return RetainOutcome(self.retained + other.retained, self.refused + other.refused,
                             self.block_seconds + other.block_seconds, self.rows + other.rows)


@dataclass(slots=True)
class TenantRetention:
    """A tenant's retention now: blocks, bytes (counted at the block's raw size), its bound, and
    the next deadline to pass (None: nothing retained)."""
    blocks: int = 0
    bytes: int = 0
    bound_bytes: int = 0
    next_deadline: float | None = None
    by_class: dict[str, int] = field(default_factory=dict)     # class -> blocks

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "bytes": self.bytes, "bound_bytes": self.bound_bytes,
                "next_deadline": self.next_deadline, "blocks_by_class": dict(self.by_class)}


class Retention:
    def __init__(self, block_bytes: int, max_bytes: int, per_tenant_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        """`block_bytes`: one block's raw bytes (what a retained block counts). `max_bytes`: every
        tenant's retention together (0: retention is off -- there is no tier to keep it in).
        `per_tenant_bytes`: one tenant's bound. `clock`: wall-clock seconds (tests inject one)."""
        if block_bytes <= 0 or max_bytes < 0 or per_tenant_bytes < 0:
            raise ValueError("Retention: block_bytes > 0, max_bytes >= 0 and per_tenant_bytes >= 0")
        self.block_bytes = block_bytes
        self.max_bytes = max_bytes
        self.per_tenant_bytes = min(per_tenant_bytes, max_bytes)
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[bytes, dict[str, tuple[float, str]]] = {}   # hash -> tenant -> (deadline, class)
        self._tenant_blocks: dict[str, int] = {}
        self._heap: list[tuple[float, bytes, str]] = []   # (deadline, hash, tenant); stale entries skipped
        self._written: dict[tuple[bytes, str], float] = {}  # (hash, tenant) -> the deadline the disk was given
        self.expired = 0            # (block, tenant) retentions that ran out
        self.refused = 0            # blocks refused by a bound

    @property
    def enabled(self) -> bool:
        return self.max_bytes >= self.block_bytes and self.per_tenant_bytes >= self.block_bytes

    # -- asks ------------------------------------------------------------------------------------
    def retain(self, tenant: str, keys: Sequence[BlockKey], klass: str) -> RetainOutcome:
        """Retain these blocks (a chain, in order) for `tenant` until now + the class's seconds; a
        block retained already keeps the later of its two deadlines."""
        ttl = retention_seconds(klass)
        if not keys:
            return RetainOutcome()
        with self._lock:
            now = self.clock()
            self._expire(now)
            deadline = now + ttl
            kept = refused = 0
            bought = 0.0
            rows = []
            for i, key in enumerate(keys):
                held = self._held.get(key.hash)
                mine = held.get(tenant) if held else None
                if mine is None:
                    if not self._fits(tenant, key.hash):
                        refused = len(keys) - i
                        break
                    self._held.setdefault(key.hash, {})[tenant] = (deadline, klass)
                    self._tenant_blocks[tenant] = self._tenant_blocks.get(tenant, 0) + 1
                    bought += ttl
                elif deadline > mine[0]:
                    bought += deadline - max(mine[0], now)
                    held[tenant] = (deadline, klass)      # (its heap entry is pushed on when popped)
                if mine is None:
                    heapq.heappush(self._heap, (deadline, key.hash, tenant))
                kept += 1
                # NOTE: the disk is handed a deadline WRITE_AHEAD of the class later than the one
                # kept, so the refreshes of a hot prefix (every hit) write nothing until it is
                # reached: after a restart a block may be kept that much past what was paid, never
                # less. A row the disk lost (unwritten) is written again by the next ask.
                until, its_class = held[tenant] if mine is not None else (deadline, klass)
                if until > self._written.get((key.hash, tenant), 0.0):
                    ahead = until + WRITE_AHEAD * retention_seconds(its_class)
                    self._written[(key.hash, tenant)] = ahead
                    rows.append(RetainRow(key.hash, tenant, ahead, its_class))
            self.refused += refused
        return RetainOutcome(kept, refused, bought, tuple(rows))

    def _fits(self, tenant: str, h: bytes) -> bool:
        mine = (self._tenant_blocks.get(tenant, 0) + 1) * self.block_bytes
        everyone = (len(self._held) + (h not in self._held)) * self.block_bytes
        return mine <= self.per_tenant_bytes and everyone <= self.max_bytes

    def load(self, rows: Iterable[RetainRow]) -> list[RetainRow]:
        """Deadlines read back at start (the disk's rows). Those passed are left to the disk (its
        evictions delete them); those past the bounds (written under a larger configuration) are
        returned, for the disk to forget, so it keeps no more than this book allows."""
        over: list[RetainRow] = []
        with self._lock:
            now = self.clock()
            for r in sorted(rows, key=lambda r: -r.deadline):     # the longest paid-for first
                if r.deadline <= now:
                    continue
                held = self._held.get(r.block_hash, {})
                if r.tenant in held:          # (one row per block and tenant: a repeat is harmless)
                    continue
                if not self._fits(r.tenant, r.block_hash):
                    over.append(r)
                    continue
                self._held.setdefault(r.block_hash, {})[r.tenant] = (r.deadline, r.klass)
                self._written[(r.block_hash, r.tenant)] = r.deadline
                self._tenant_blocks[r.tenant] = self._tenant_blocks.get(r.tenant, 0) + 1
                heapq.heappush(self._heap, (r.deadline, r.block_hash, r.tenant))
        return over

    def unwritten(self, rows: Iterable[RetainRow]) -> None:
        """Rows the disk could not write (writes off, a stalled or replaced store): the next ask
        for those blocks writes them again."""
        with self._lock:
            for r in rows:
                if self._written.get((r.block_hash, r.tenant)) == r.deadline:
                    del self._written[(r.block_hash, r.tenant)]

    # -- what the tiers ask ----------------------------------------------------------------------
    def live(self, h: bytes) -> bool:
        """Whether any tenant retains block `h` now (a deadline not yet passed). No I/O, no waits."""
        held = self._held.get(h)          # NOTE: read without the lock first: most blocks are not retained
        if not held:
            return False
        with self._lock:
            now = self.clock()
            return any(d > now for d, _ in self._held.get(h, {}).values())

    def _expire(self, now: float) -> int:
        n = 0
        while self._heap and self._heap[0][0] <= now:
            d, h, tenant = heapq.heappop(self._heap)
            held = self._held.get(h)
            if not held or tenant not in held:
                continue       # gone
            if held[tenant][0] > d:
                # Refreshed since: one heap entry per (block, tenant), pushed again at its deadline
                # (a refresh pushes none, so a hot prefix's refreshes never pile up here).
                heapq.heappush(self._heap, (held[tenant][0], h, tenant))
                continue
            del held[tenant]
            self._written.pop((h, tenant), None)
            if not held:
                del self._held[h]
            self._tenant_blocks[tenant] -= 1
            if not self._tenant_blocks[tenant]:
                del self._tenant_blocks[tenant]
            n += 1
        self.expired += n
        return n

    def tenants(self) -> dict[str, TenantRetention]:
        """Each tenant's retention now."""
        with self._lock:
            self._expire(self.clock())
            out: dict[str, TenantRetention] = {}
            for held in self._held.values():
                for tenant, (d, klass) in held.items():
                    t = out.setdefault(tenant, TenantRetention(bound_bytes=self.per_tenant_bytes))
                    t.blocks += 1
                    t.bytes += self.block_bytes
                    t.next_deadline = d if t.next_deadline is None else min(t.next_deadline, d)
                    t.by_class[klass] = t.by_class.get(klass, 0) + 1
            return out

    def blocks(self) -> int:
        """Blocks retained by anyone now."""
        with self._lock:
            self._expire(self.clock())
            return len(self._held)
