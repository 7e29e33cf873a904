"""Room in the disk store: the map bounded by the filesystem's free space, and LRU eviction, both
inside a commit's transaction (the capacity bound) and in transactions of its own after
MapFull/ENOSPC (make_room). Room in the store, not in the writer's queue (wait_for_room).

Knows: the filesystem's free space and the reserve the store leaves on it, the map size LMDB lets
the data file grow to (shrunk at once, grown back in steps), the LRU database's order and how to
delete from it without looping on a damaged tree, and LMDB's rule that freed pages are reused only
two transactions later. Doesn't know: the writer's queue, encoding or batching
(storage/disk/writer.py), or the record formats beyond storage/disk/records.py's functions.

Thread: the disk writer's (`tieredkv-disk-writer`) -- it alone calls these and owns `FreeSpace`'s
state, but for `FreeSpace.space`, a tuple replaced whole, which stats() reads from any thread.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import lmdb

from storage.disk.gate import EnvGate
from storage.disk.index import DiskIndex
from storage.disk.records import (StoreDamaged, StoreInfo, delete_in_txn, load_capacity, load_info, lru_hash, lru_key,
                                  read_meta, store_info)
from storage.disk.retained import live_deadline
from storage.disk.verdicts import is_no_space

log = logging.getLogger(__name__)

_SPACE_CHECK_S = 0.5    # how often the writer reads the filesystem's free space
_MAP_STEP = 16 << 20    # the map grows back toward its full size in steps of at least this


class FreeSpace:
    """The store never grows into the last `reserve_bytes` of its filesystem (issue 17, item 2):
    the billing ledger and everything else on the disk need them. `reserve_bytes` None: no such
    bound. Writer thread only, but for `space` (read by stats())."""

    def __init__(self, gate: EnvGate, capacity_bytes: int, reserve_bytes: int | None, map_size: int | None) -> None:
        self._gate = gate
        self._capacity_bytes = capacity_bytes
        self._reserve = reserve_bytes
        self._full_map = map_size
        self._last_space_check = -1e9
        self._last_set: int | None = None        # the map size this writer last set
        self._warned_capacity = False
        self.growth_left: int | None = None      # bytes the data file may still grow; None: unbounded
        self.space: tuple[int | None, int | None] = (None, None)   # (free bytes, the map's bound or None)

    def capacity_in(self, txn: lmdb.Transaction) -> int:
        """The store's capacity, read in the committing transaction (another process may have
        changed it); warns once when it is not this process's configured one."""
        capacity = load_capacity(txn, self._gate.dbs) or self._capacity_bytes
        if capacity != self._capacity_bytes and not self._warned_capacity:
            self._warned_capacity = True
            log.warning("disk tier: another process set the capacity to %d bytes (this one was configured "
                        "with %d); enforcing the store's %d", capacity, self._capacity_bytes, capacity)
        return capacity

    def fit(self, force: bool = False) -> None:
        """Bound the data file by the filesystem's free space minus the reserve: the map size is the
        most LMDB lets the file grow to, so a commit that would eat into the reserve gets MapFull,
        which evicts (LRU) and reuses the freed pages inside the file: a smaller cache, never a
        full filesystem. Checked at most twice a second (statvfs), and on every MapFull/ENOSPC."""
        if self._reserve is None or self._full_map is None:
            return
        now = time.monotonic()
        if not force and now - self._last_space_check < _SPACE_CHECK_S:
            return
        self._last_space_check = now
        try:
            st = os.statvfs(self._gate.env.path())
            used = os.path.getsize(os.path.join(self._gate.env.path(), "data.mdb"))
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        # At most a tenth of the filesystem: a reserve larger than a small disk would leave no tier.
        reserve = min(self._reserve, st.f_blocks * st.f_frsize // 10)
        room = free - reserve
        current = self._gate.info()["map_size"]     # after the files' check (it reads the map)
        if current != self._last_set and current > self._full_map:
            self._full_map = current          # another process grew the map: that is the full size now
        target = min(self._full_map, used + max(0, room))
        # Hysteresis: shrink at once, grow back only by a good step (each change waits for every
        # open transaction of the process).
        if target < current or target >= current + _MAP_STEP or (target == self._full_map != current):
            current = self._last_set = self._gate.set_map_size(target)
            # Said once per change, and as a warning only when the file's bound is below the
            # configured capacity (the cache really is smaller); above it the map's slack shrinks.
            if current < self._full_map:
                log.log(logging.WARNING if current < self._capacity_bytes else logging.DEBUG,"disk tier %s: %d bytes free on its filesystem, %d reserved: the store is bounded "
                            "at %d bytes of file (a smaller cache, LRU first)", self._gate.env.path(), free,
                            reserve, current)
        self.growth_left = None if current >= self._full_map else max(0, current - used)
        self.space = (free, None if current >= self._full_map else current)


def make_room(begin: Callable, gate: EnvGate, index: DiskIndex, count: Callable[..., None], now: float,
              target: int) -> int:
    """Evict LRU blocks until `target` stored bytes are freed, in a transaction of its own
    (smaller ones if even the deletes hit MapFull). Returns the bytes freed. `begin`: the writer's
    transactions (gate.begin); `count(evictions=n)` the tier's counter; `now`: wall-clock seconds
    (retention deadlines)."""
    freed, per_txn = 0, 64
    while freed < target:
        try:
            with begin(write=True) as txn:
                info = load_info(txn, gate.dbs)
                before, limit = info.used_bytes, [per_txn]

                def more() -> bool:
                    limit[0] -= 1
                    return limit[0] >= 0 and before - info.used_bytes + freed < target
                gone: list[bytes] = []
                n = evict_in_txn(txn, gate.dbs, info, more, gone, now)
                store_info(txn, gate.dbs, info)
            index.discard(gone)
        except Exception as e:
            if not is_no_space(e, gate.env.path()):
                raise
            if per_txn == 1:
                # Not even one delete fits: every page is taken or still visible to the
                # last two snapshots. Give the caller what was freed; its next attempt
                # comes after the small commit below, which makes freed pages reusable.
                break
            per_txn = max(1, per_txn // 4)
            continue
        count(evictions=n)
        freed += before - info.used_bytes
        if n == 0:
            break
    # LMDB reuses a page freed by transaction N only from transaction N+2 on (N+1 may still
    # be read against N's snapshot), so commit one small transaction before the retry.
    try:
        with begin(write=True) as txn:
            store_info(txn, gate.dbs, load_info(txn, gate.dbs))
    except Exception as e:
        if not is_no_space(e, gate.env.path()):
            raise
    return freed


def evict_in_txn(txn: lmdb.Transaction, dbs, info: StoreInfo, more: Callable[[], bool], evicted: list[bytes],
                 now: float | None = None) -> int:
    """Delete least recently used blocks while more() says so, appending their hashes to
    `evicted`. Returns how many. `dbs`: the gate's databases, read inside `txn`.

    Retention (issue 39): a block a tenant retains past `now` (storage/disk/retained.py) is not
    deleted but moved to the back of the LRU order (a new access sequence), so each retained
    block is passed over once per walk; once the walk meets a block it moved, every block left is
    retained, and while more() still asks, retained blocks are evicted too (the capacity bound is
    the invariant; the retention bounds keep this from happening, storage/retention.py). A row
    whose deadlines all passed is deleted and its block evicted as any other.

    NOTE: bounded. Each turn deletes the LRU database's first entry and proves it did (the
    next first entry is another key); one that comes back means the lru tree is out of order
    (a flipped bit in a leaf: LMDB's search no longer finds the key its cursor is on), which
    is StoreDamaged -- the store is replaced -- never a loop. At most as many turns as the
    database has entries, plus one."""
    n = 0
    turns = txn.stat(dbs.lru)["entries"] + 1
    cur = txn.cursor(db=dbs.lru)
    moved: set[bytes] = set()             # the lru keys this walk moved to the back
    retains = dbs.retain if now is not None else None
    while more():
        # The first entry that is not retained; retained ones move to the back on the way (a
        # move is no eviction: more() is not asked again for it, and it adds the turn it used).
        while True:
            if turns == 0:
                raise StoreDamaged("the lru database holds more entries than it says (its tree is damaged)")
            turns -= 1
            if not cur.first():
                return n
            first = bytes(cur.key())
            h = lru_hash(first)
            if first in moved:
                # Every block left is retained and the store is still over its bound (rows a
                # larger configuration wrote, stored sizes past the raw bytes the bound counts):
                # the capacity invariant wins, retained blocks go too, oldest first.
                log.warning("disk tier: every block left is retained and the store is over its capacity: "
                            "evicting retained blocks (is --max-retained close to --disk-capacity?)")
                retains = None
                moved.clear()
            raw, m = read_meta(txn, dbs, h)
            if (m is None or retains is None or lru_key(m.last_access, h) != first
                    or live_deadline(txn, retains, h, now) is None):
                break
            cur.delete()                  # retained: to the back of the LRU order
            if cur.first() and bytes(cur.key()) == first:
                raise StoreDamaged(f"lru entry {first.hex()[:24]} survives its delete (the lru tree is damaged)")
            m.last_access = info.next_seq
            info.next_seq += 1
            txn.put(h, m.pack(), db=dbs.meta)
            moved.add(lru_key(m.last_access, h))
            txn.put(lru_key(m.last_access, h), b"", db=dbs.lru)
            turns += 1                    # its new entry is walked again at most once
        if m is not None and lru_key(m.last_access, h) == first:
            delete_in_txn(txn, dbs, h, info)     # raises StoreDamaged if it deleted nothing
            n += 1
            evicted.append(h)
        elif m is None and raw is not None:
            delete_in_txn(txn, dbs, h, info)     # undecodable meta: deleted with a recount
            evicted.append(h)
        if cur.first() and bytes(cur.key()) == first:
            cur.delete()                         # a stray entry: no block, or an older sequence
            if cur.first() and bytes(cur.key()) == first:
                raise StoreDamaged(f"lru entry {first.hex()[:24]} survives its delete (the lru tree is damaged)")
    return n
