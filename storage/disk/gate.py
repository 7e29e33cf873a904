"""The transaction gate: every transaction of this process on the disk tier's environment (any
thread) goes through it, and the environment itself may be replaced only while none is open.

Knows: the gate every transaction goes through -- close(), the adoption of a map another process
grew (LMDB's MAP_RESIZED) and the replacement of a damaged store wait until no transaction of this
process is open, since buffers=True reads hold views into the map --, the check of the store's
files before each transaction (storage/disk/liveness.py), and which errors it reports as damage
(storage/disk/verdicts.py).
Doesn't know: how an environment is opened (storage/disk/environment.py), blocks or records.

NOTE invariant (issues 17 and 28): an LMDB error is a verdict on the store, never a loop or a dead
process. Every transaction goes through EnvGate.begin; the store's files are checked first (a file
shrunk, unlinked or overwritten is damage found before LMDB touches a page past its end), and an
error that is_damage() raised in one (at begin, inside, or at commit) is reported to the gate's
`on_damage` once the transaction is closed, and the tier replaces the store
(storage/disk/replacement.py). The caller still sees the error, and turns it into what it always
does: a miss, or a batch retried on the fresh store.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterator

import lmdb

from storage.disk.environment import _ABANDONED, DiskUnavailable
from storage.disk.liveness import StoreFiles
from storage.disk.map_faults import MapWatch
from storage.disk.records import Databases, StoreDamaged
from storage.disk.verdicts import is_damage
from storage.disk.write_switch import unwritable

__all__ = ["EnvGate"]

log = logging.getLogger(__name__)

_CHUNK = 512                     # keys per read transaction when iterating a whole database


class EnvGate:
    """Every transaction of this process on one environment (any thread), and the environment
    itself: `_env` and `dbs` may be replaced (a damaged store, a map another process grew), but
    only while no transaction is open -- so read `dbs` inside a transaction, never before it.
    A transaction must never open another one."""

    def __init__(self, env: lmdb.Environment, dbs: Databases, path: str) -> None:
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

    @property
    def env(self) -> lmdb.Environment:
        return self._env

    @contextlib.contextmanager
    def begin(self, **kw: object) -> Iterator[lmdb.Transaction]:
        """Every transaction of this process (reads, deletes, the writer's commits) goes through
        here. close(), a map resize and a store replacement wait until none is open, since they
        unmap the file that buffers=True reads hold views into. A transaction must never open
        another one.

        Another process may grow the map (it opened with a larger capacity): LMDB then refuses
        our next transaction with MAP_RESIZED until this process adopts the new size, which
        is only safe while no transaction of ours is open (item 5 of issue 7)."""
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
            try:
                self.files.check()
                self.maps.check()
                try:
                    txn = self._env.begin(**kw)
                except lmdb.MapResizedError:
                    if attempt == 2:
                        raise
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                        # NOTE: before a commit: a write that read zeros is aborted, a read's
                        # results are thrown away (the caller takes its miss).
                        self.maps.check()
                    self.maps.check()          # the commit's own reads (its free-page list)
                    return
            except Exception as e:
                # A fault absorbed during the transaction is damage, whatever the zeros made
                # LMDB or the caller raise (and the reason the store is moved aside).
                damage = self.maps.damage() or (e if is_damage(e) else None)
                raise
            finally:
                with self._cond:
                    self._in_txn -= 1
                    self._cond.notify_all()
                if damage is not None:
                    self._report(damage, generation)
            self._guarded(self._adopt_map_size, generation)

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
            self.maps.close()
            if damaged:
                _ABANDONED.append(self._env)
            else:
                self._env.close()
            self.files.close()
            try:
                self._env, self.dbs = reopen()
            except BaseException as e:
                self._down = f"{self._path}: no usable store ({type(e).__name__}: {e})"
                raise
            self.generation += 1
            self.files = StoreFiles(self._path)
            self.maps = MapWatch(self._path)
            return True
        finally:
            self._release()

    def iter_db(self, name: str, values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        """Every (key, value) of the database `name` ("payload", "meta", "lru") in key order, read
        _CHUNK keys per transaction, so no read transaction stays open long (a long one pins old
        pages against reuse)."""
        last = None
        while True:
            with self.begin() as txn:
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
        self.maps.close()
        if self._down is None:          # a tier that went down abandoned its damaged environment
            self._env.close()
            self.files.close()
