"""The disk's record of retained blocks (issue 39, item 1): the `retain` database, hash -> every
tenant's deadline on that block, written with the blocks' other records so that deadlines survive
a restart, and read inside the commits that evict so that a retained block is not evicted before
its deadline (storage/disk/room.py moves it to the back of the LRU order instead).

A row may name a block the store does not hold (yet: it is retained while still in the device
pool or the host slab, and written down behind it); it costs a few bytes and goes with its last
deadline. Rows whose deadlines all passed are deleted by the next commit that meets them.

Value: one entry per tenant, each `u64 deadline (ms since the epoch) | u8 class | u16 tenant
length | tenant (UTF-8)`. A value that cannot be decoded is no retention (the block is ordinary
LRU again) and is deleted; retention never makes a damaged store serve anything.

Knows: the byte layout, the in-transaction reads and merges, and the tier's verbs (DiskRetention:
rows handed to the writer, read back at start). Doesn't know: the bounds or the
tenants' books (storage/retention.py), or when rows are written (storage/disk/writer.py).
"""
from __future__ import annotations

import logging
import struct
from typing import Callable, Iterator, Sequence

import lmdb

from storage.retention import RETENTION_SECONDS, RetainRow

__all__ = ["DiskRetention", "decode", "encode", "live_deadline", "merge_in_txn", "rows_in_txn"]

log = logging.getLogger(__name__)

_CLASSES = tuple(RETENTION_SECONDS)          # the class byte: its index here
_ENTRY = struct.Struct("<QBH")


def encode(entries: dict[str, tuple[float, str]]) -> bytes:
    """tenant -> (deadline, class) as a `retain` value."""
    out = bytearray()
    for tenant, (deadline, klass) in sorted(entries.items()):
        name = tenant.encode()
        out += _ENTRY.pack(int(deadline * 1000), _CLASSES.index(klass), len(name)) + name
    return bytes(out)


def decode(raw: bytes) -> dict[str, tuple[float, str]]:
    """A `retain` value back (ValueError when it is damaged)."""
    out: dict[str, tuple[float, str]] = {}
    view, i = memoryview(raw), 0
    while i < len(view):
        if i + _ENTRY.size > len(view):
            raise ValueError("a retain entry is cut short")
        ms, k, n = _ENTRY.unpack_from(view, i)
        i += _ENTRY.size
        if k >= len(_CLASSES) or i + n > len(view):
            raise ValueError("a retain entry is damaged")
        out[bytes(view[i:i + n]).decode()] = (ms / 1000.0, _CLASSES[k])
        i += n
    return out


def _read(txn: lmdb.Transaction, db, h: bytes) -> dict[str, tuple[float, str]] | None:
    raw = txn.get(h, db=db)
    if raw is None:
        return None
    try:
        return decode(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        return {}


def live_deadline(txn: lmdb.Transaction, db, h: bytes, now: float) -> float | None:
    """The latest deadline still ahead on block `h`, or None. A row with none ahead (or damaged)
    is deleted in `txn` (a write transaction)."""
    entries = _read(txn, db, h)
    if entries is None:
        return None
    ahead = [d for d, _ in entries.values() if d > now]
    if not ahead:
        txn.delete(h, db=db)
        return None
    return max(ahead)


def merge_in_txn(txn: lmdb.Transaction, db, rows: list[RetainRow], now: float) -> None:
    """Write these rows, each tenant's deadline the later of the stored and the new one; a row
    with a deadline <= 0 removes its tenant's entry; entries passed are dropped on the way."""
    by_hash: dict[bytes, list[RetainRow]] = {}
    for r in rows:
        by_hash.setdefault(r.block_hash, []).append(r)
    for h, mine in by_hash.items():
        entries = {t: e for t, e in (_read(txn, db, h) or {}).items() if e[0] > now}
        for r in mine:
            if r.deadline <= 0:
                entries.pop(r.tenant, None)        # forgotten (over this configuration's bounds)
            elif r.tenant not in entries or r.deadline > entries[r.tenant][0]:
                entries[r.tenant] = (r.deadline, r.klass)
        if entries:
            txn.put(h, encode(entries), db=db)
        else:
            txn.delete(h, db=db)


def rows_in_txn(txn: lmdb.Transaction, db) -> Iterator[RetainRow]:
    """Every row the store holds (a damaged value yields nothing)."""
    for h, raw in txn.cursor(db=db):
        try:
            entries = decode(bytes(raw))
        except (ValueError, UnicodeDecodeError):
            continue
        for tenant, (deadline, klass) in entries.items():
            yield RetainRow(bytes(h), tenant, deadline, klass)


class DiskRetention:
    """The disk tier's retention verbs (storage/lower_tier.py's `retain`, `open_retention`), mixed
    into DiskTier: rows go to the writer, committed with its next batch; read back at start."""

    def retain(self, rows: Sequence[RetainRow]) -> bool:
        if self.readonly:
            return False
        self._writer.record_retains(rows)
        return True

    def open_retention(self, clock: Callable[[], float],
                       lost: Callable[[list[RetainRow]], None] | None = None) -> list[RetainRow]:
        """Every retention row the store holds (none while it does not answer); `clock`: wall-clock
        seconds for the writer's deadlines from now on (tests inject one); `lost`: called (on the
        writer's thread) with rows it could not write."""
        self._writer.clock = clock
        self._writer.retains_lost = lost
        return self.retained_rows()

    def retained_rows(self) -> list[RetainRow]:
        """Every retention row the store holds, deadlines passed included (`tieredkv inspect`)."""
        try:
            with self._begin() as txn:
                db = self._gate.dbs.retain
                return [] if db is None else list(rows_in_txn(txn, db))
        except (lmdb.Error, OSError) as e:          # DiskUnavailable and DiskStalled are OSErrors
            log.warning("disk tier %s: retention rows could not be read (%s): none restored", self.path, e)
            return []
