"""The transaction gate: every transaction of this process on the disk tier's environment (any
thread) goes through it, and the environment itself may be replaced only while none is open.

Knows: the gate every transaction goes through -- close(), the adoption of a map another process
grew (LMDB's MAP_RESIZED) and the replacement of a damaged store wait until no transaction of this
process is open, since buffers=True reads hold views into the map --, the check of the store's
files before each transaction (storage/disk/liveness.py), which errors it reports as damage
(storage/disk/verdicts.py), and a filesystem that stops answering (issue 44, item 3: below).
Doesn't know: how an environment is opened (storage/disk/environment.py), blocks or records.

NOTE invariant (issues 17 and 28): an LMDB error is a verdict on the store, never a loop or a dead
process. Every transaction goes through EnvGate.begin; the store's files are checked first (a file
shrunk, unlinked or overwritten is damage found before LMDB touches a page past its end), and an
error that is_damage() raised in one (at begin, inside, or at commit) is reported to the gate's
`on_damage` once the transaction is closed, and the tier replaces the store
(storage/disk/replacement.py). The caller still sees the error, and turns it into what it always
does: a miss, or a batch retried on the fresh store.

NOTE invariant (issue 44, item 3): no transaction holds the interpreter while the filesystem is
frozen or hung. py-lmdb begins and ends read transactions (and runs reader_check) with the GIL held,
and each stores into lock.mdb's map: each is preceded by a touch of those pages with the GIL
released (storage/disk/lock_pages.py: on the reading thread, or for status on a thread of its own,
bounded). A read that cannot end so is left open, and ended (and every ended one freed: py-lmdb's
dealloc stores too) right after the next touch. Write transactions, whose begin (LMDB's writer mutex) and commit release the GIL, are
taken one at a time through a Python lock, waited for only while the holder is not stalled
(storage/disk/stall.py). While a stall lasts every transaction is refused at once (DiskStalled).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Callable, Iterator

import lmdb

from storage.disk.environment import _ABANDONED, DiskUnavailable
from storage.disk.liveness import StoreFiles
from storage.disk.lock_pages import LockPages
from storage.disk.map_faults import MapWatch
from storage.disk.records import Databases, StoreDamaged
from storage.disk.stall import DEFAULT_STALL_S, DiskStalled, StallWatch
from storage.disk.verdicts import is_damage
from storage.disk.write_switch import unwritable

__all__ = ["EnvGate"]

log = logging.getLogger(__name__)

_CHUNK = 512                     # keys per read transaction when iterating a whole database
_KEPT: list = []                 # transactions never freed: their store's lock file never became writable again


class EnvGate:
    """Every transaction of this process on one environment (any thread), and the environment
    itself: `_env` and `dbs` may be replaced (a damaged store, a map another process grew), but
    only while no transaction is open -- so read `dbs` inside a transaction, never before it.
    A transaction must never open another one."""

    def __init__(self, env: lmdb.Environment, dbs: Databases, path: str, stall_s: float = DEFAULT_STALL_S) -> None:
        self._env = env
        self.dbs = dbs
        self._path = path
        self._cond = threading.Condition()          # guards _stopping, _in_txn, _resizing, generation
        self._stopping = False
        self._in_txn = 0                            # this process's open transactions (any thread)
        self._down: str | None = None               # why no store can be had (begin raises DiskUnavailable)
        self._resizing = False                      # a thread is adopting a new map or a new store
        self.generation = 0                         # +1 each time the store is replaced
        # NOTE invariant (issue 28): the files this gate maps, checked before every transaction
        # (storage/disk/liveness.py): a shrunk, unlinked or overwritten file is damage, found
        # before LMDB touches a page past its end.
        self.files = StoreFiles(path)
        # NOTE invariant (issue 28): a truncate that lands inside a transaction, after that check,
        # reads as zeros instead of a SIGBUS (storage/disk/map_faults.py); the watch is checked
        # before and after every transaction, and a fault is damage.
        self.maps = MapWatch(path)
        # Called (error, generation) on the thread that saw a DAMAGE_ERRORS error, after its
        # transaction closed; the tier replaces the store. None: nothing is done (readonly).
        self.on_damage: Callable[[BaseException, int], None] | None = None
        # Issue 44, item 3: the calls that may wait as long as a frozen filesystem does, watched
        # (storage/disk/stall.py); this process's write transactions, one at a time; read
        # transactions left open by a stall and ended ones not yet freed (guarded by _txns_lock:
        # both ended and freed right after a touch of the lock file, its turn held).
        self.stall = StallWatch(path, stall_s)
        self._writes = threading.Lock()
        self._txns_lock = threading.Lock()
        self._left: list[lmdb.Transaction] = []
        self._ended: list[lmdb.Transaction] = []
        self.pages = LockPages(os.path.join(path, "lock.mdb"), self.stall, self._after_touch)

    @property
    def env(self) -> lmdb.Environment:
        return self._env

    @contextlib.contextmanager
    def begin(self, bounded: float | None = None, **kw: object) -> Iterator[lmdb.Transaction]:
        """Every transaction of this process (reads, deletes, the writer's commits) goes through
        here. close(), a map resize and a store replacement wait until none is open, since they
        unmap the file that buffers=True reads hold views into. A transaction must never open
        another one.

        Another process may grow the map (it opened with a larger capacity): LMDB then refuses
        our next transaction with MAP_RESIZED until this process adopts the new size, which
        is only safe while no transaction of ours is open (item 5 of issue 7).

        A read's thread makes the lock file writable itself (storage/disk/lock_pages.py: on a
        frozen filesystem the first one waits, GIL released, until the thaw; the others get
        DiskStalled); `bounded`: never wait more than that many seconds (status: another thread
        touches). A write waits for this process's other write while that one is not stalled."""
        write = bool(kw.get("write"))
        for attempt in range(3):
            with self._cond:
                while self._resizing:
                    self._cond.wait()
                if self._stopping:
                    raise RuntimeError("DiskTier is closed")
                if self._down is not None:
                    raise DiskUnavailable(self._down)
                self._in_txn += 1
                generation = self.generation
            damage = None
            locked = left_open = False
            try:
                self.stall.check(reads=not write)
                self.files.check()
                self.maps.check()
                if write:
                    locked = self._lock_writes()
                else:
                    self._touch(bounded)
                try:
                    if write:
                        with self.stall.op("write", "a write transaction's begin (LMDB's writer lock)"):
                            txn = self._env.begin(**kw)
                    else:
                        txn = self._env.begin(**kw)
                except lmdb.MapResizedError:
                    if attempt == 2:
                        raise
                    txn = None
                if txn is not None:
                    try:
                        yield txn
                        # NOTE: before a commit: a write that read zeros is aborted, a read's
                        # results are thrown away (the caller takes its miss).
                        self.maps.check()
                    except BaseException:
                        left_open = self._end(txn, write, False, bounded)
                        raise
                    left_open = self._end(txn, write, True, bounded)
                    self.maps.check()          # the commit's own reads (its free-page list)
                    return
            except Exception as e:
                # A fault absorbed during the transaction is damage, whatever the zeros made
                # LMDB or the caller raise (and the reason the store is moved aside).
                damage = self.maps.damage() or (e if is_damage(e) else None)
                raise
            finally:
                if locked:
                    self._writes.release()
                with self._cond:
                    if not left_open:          # (one left open is counted until a touch ends it)
                        self._in_txn -= 1
                    self._cond.notify_all()
                if damage is not None:
                    self._report(damage, generation)
            self._guarded(self._adopt_map_size, generation)

    def _lock_writes(self) -> bool:
        """This process's write transactions one at a time, here rather than on LMDB's writer mutex
        (waited for inside C, for as long as a frozen filesystem holds its owner's commit):
        waited for while the holder is not stalled, else DiskStalled."""
        while not self._writes.acquire(timeout=0.05):
            self.stall.check()
        return True

    def _touch(self, bounded: float | None) -> None:
        if bounded is None:
            self.pages.touch_here(self.stall.stall_s)
        else:
            self.pages.touch(bounded)

    def _end(self, txn: lmdb.Transaction, write: bool, commit: bool, bounded: float | None) -> bool:
        """Commit or abort; True when a read was left open (its end would store into a lock file
        the filesystem does not let become writable: the first touch after the thaw ends it)."""
        if write:
            if commit:
                with self.stall.op("write", "a commit"):
                    txn.commit()
            else:
                txn.abort()
            return False
        if not self.pages.active:
            txn.abort()
            return False
        try:
            self._touch(bounded)
        except DiskStalled:
            with self._txns_lock:
                self._left.append(txn)
            return True
        txn.abort()      # a read's commit and abort are one: mdb_txn_reset (a store into the lock file)
        with self._txns_lock:
            self._ended.append(txn)
        return False

    def _after_touch(self) -> None:
        """Right after a touch made the lock file writable (its turn held): the reads left open
        are ended, and every ended read nobody else holds is freed (py-lmdb's dealloc resets or
        aborts it: one more store into the lock file)."""
        with self._txns_lock:
            left, self._left = self._left, []
            ended, self._ended = self._ended, []
        _abort_all(left)
        n = len(left)
        ended.extend(left)
        left.clear()
        kept = _still_held(ended)
        with self._txns_lock:
            self._ended.extend(kept)
        ended.clear()                     # NOTE: the frees, here
        if n:
            with self._cond:
                self._in_txn -= n
                self._cond.notify_all()

    def _guarded(self, fn: Callable[[], object], generation: int) -> object:
        """fn(); an error of it that is damage is reported (once it returned), then raised."""
        try:
            return fn()
        except Exception as e:
            if is_damage(e):
                self._report(e, generation)
            raise

    def _checked(self, fn: Callable[[], object]) -> object:
        """fn() after the files' check, counted as a transaction (a replacement waits for it: it
        closes the descriptors the check reads); damage reported, then raised."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            if self._stopping or self._down is not None:
                raise DiskUnavailable(self._down or f"{self._path}: the disk tier is closed")
            self._in_txn += 1
            generation = self.generation

        def run() -> object:
            try:
                self.files.check()
                self.maps.check()
                out = fn()
                self.maps.check()
                return out
            finally:
                with self._cond:
                    self._in_txn -= 1
                    self._cond.notify_all()
        return self._guarded(run, generation)

    def check(self) -> None:
        """The writer's tick: the files checked outside any transaction; damage reported, raised."""
        self._checked(lambda: None)

    def reader_check(self) -> int:
        """LMDB's reader_check: dead processes' reader slots freed (it stores into the lock file
        with the GIL held: the file is touched first)."""
        def run() -> int:
            self.pages.touch_here(self.stall.stall_s)
            return self._env.reader_check()
        return self._checked(run)

    def info(self) -> dict:
        """LMDB's env.info() (it reads the meta pages through the map), after the files' check."""
        return self._checked(self._env.info)

    def _report(self, e: BaseException, generation: int) -> None:
        if self.on_damage is None:
            return
        try:
            self.on_damage(e, generation)
        except Exception:      # the caller's own error is what it sees; this is logged
            log.exception("disk tier %s: replacing the damaged store failed", self._path)

    def _exclusive(self) -> None:
        """Wait until no transaction is open and keep new ones out (undo with _release)."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._in_txn:
                self._cond.wait()

    def _release(self) -> None:
        with self._cond:
            self._resizing = False
            self._cond.notify_all()

    def _writable(self) -> None:
        """Raise unless the directory takes writes. NOTE (issue 41): on a read-only or aborted
        filesystem LMDB's remap fails after it unmapped the store, and the environment is lost --
        to a fault that passes. Raised before it: the writer turns its writes off instead."""
        why = unwritable(self._path)
        if why is not None:
            raise why

    def _adopt_map_size(self) -> None:
        self._writable()
        self._exclusive()
        try:
            self.files.check()
            self._env.set_mapsize(0)   # 0: take the size another process set
            log.warning("disk tier %s: another process grew the map; now %d bytes", self._path,
                        self._env.info()["map_size"])
        finally:
            self._release()

    def set_map_size(self, size: int) -> int:
        """Map (and so bound the data file at) `size` bytes, with no transaction open; LMDB rounds
        a size below the pages in use up to them. Returns the size now mapped."""
        self._writable()
        self._exclusive()
        try:
            self.files.check()           # set_mapsize and info read the meta pages through the map
            self._env.set_mapsize(size)
            return self._env.info()["map_size"]
        finally:
            self._release()

    def replace(self, generation: int, reopen: Callable[[], tuple[lmdb.Environment, Databases]],
                damaged: bool = True) -> bool:
        """Take `reopen()`'s environment in place of this one, with no transaction open; the old
        one is abandoned when `damaged` (see release()), else closed. False (nothing done) when
        the store was replaced since `generation` or the gate is closing. If reopen raises, the
        tier is down: every later transaction raises DiskUnavailable (a miss to every reader, a
        dropped batch to the writer)."""
        self._exclusive()
        try:
            if self.generation != generation or self._stopping or self._down is not None:
                return False
            self._retire(damaged)
            self.maps.close()
            self.files.close()
            try:
                self._env, self.dbs = reopen()
            except BaseException as e:
                self._down = f"{self._path}: no usable store ({type(e).__name__}: {e})"
                raise
            self.generation += 1
            self.files = StoreFiles(self._path)
            self.maps = MapWatch(self._path)
            self.pages = LockPages(os.path.join(self._path, "lock.mdb"), self.stall, self._after_touch)
            return True
        finally:
            self._release()

    def iter_db(self, name: str, values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        """Every (key, value) of the database `name` ("payload", "meta", "lru") in key order, read
        _CHUNK keys per transaction, so no read transaction stays open long (a long one pins old
        pages against reuse)."""
        last = None
        while True:
            with self.begin(bounded=self.stall.stall_s) as txn:     # (an admin's listing: never held by a freeze)
                cur = txn.cursor(db=getattr(self.dbs, name))
                ok = cur.first() if last is None else cur.set_range(last + b"\x00")
                rows = []
                while ok and len(rows) < _CHUNK:
                    key = cur.key()
                    # NOTE: bounded: keys must come in strictly increasing order, else a damaged
                    # tree could hand this loop the same chunk forever (set_range from `last`).
                    if (rows and key <= rows[-1][0]) or (last is not None and key <= last):
                        raise StoreDamaged(f"database {name!r}: keys out of order (its tree is damaged)")
                    rows.append((key, cur.value() if values else None))
                    ok = cur.next()
            yield from rows
            if not ok:
                return
            last = rows[-1][0]

    @property
    def down(self) -> str | None:
        """Why the tier has no store now (a replacement could not open one), or None."""
        return self._down

    def close(self) -> None:
        """Refuse new transactions, wait until none is open, and close the environment.
        NOTE: never unmap the environment under a get_many's decode."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            while self._in_txn or self._resizing:
                self._cond.wait()
        if self._down is None:          # a tier that went down abandoned its damaged environment
            self._retire(damaged=False)
            self.maps.close()
            self.files.close()
        else:
            self.maps.close()
            self.pages.close(0)

    def _retire(self, damaged: bool) -> None:
        """With no transaction open: the lock file touched a last time (the reads ended before it
        freed), its touch thread stopped, and the environment closed right after -- or abandoned,
        never unmapped, when damaged (see release()) or when its lock file cannot be made writable
        now (closing stores into it, holding the GIL); the reads still held are then never freed.
        NOTE: before the map's watch closes (a lock file truncated under us: the touch reads zeros,
        storage/disk/map_faults.py); a damaged store's map is not touched at all."""
        writable = False
        if not damaged:
            try:
                self.pages.touch(self.stall.stall_s)
                writable = True
            except DiskStalled:
                pass
        stopped = self.pages.close(self.stall.stall_s if writable else 0.0)
        if damaged or not writable or not stopped:
            with self._txns_lock:
                _KEPT.extend(self._ended)
                self._ended = []
            _ABANDONED.append(self._env)
        else:
            self._env.close()            # py-lmdb aborts the reads still held (stores, just after the touch)
            with self._txns_lock:
                self._ended = []


def _still_held(txns: list) -> list:
    """The transactions someone besides `txns` still refers to (a caller's variable): freed at a
    later touch, not by whoever drops them last."""
    # getrefcount sees: the list, the loop's name, its own argument.
    return [t for t in txns if sys.getrefcount(t) > 3]


def _abort_all(txns: list) -> None:
    for t in txns:
        t.abort()
