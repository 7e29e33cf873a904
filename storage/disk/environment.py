"""The disk tier's LMDB environment as one process holds it: opened only after its files were
checked, and every transaction of the process counted, so the map is never unmapped under a read.

Knows: how the environment is opened (meta pages checked before mapping -- a truncated file would
SIGBUS --, every page pointer walked before LMDB follows one, then our databases opened), the map
size to reserve, and the gate every transaction goes through: close() and the adoption of a map
another process grew (LMDB's MAP_RESIZED) wait until no transaction of this process is open,
since buffers=True reads hold views into the map.
Doesn't know: blocks, records or counters (storage/disk/tier.py, storage/disk/records.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

import lmdb

from storage.disk.pagewalk import check_pages
from storage.disk.preflight import DamagedEnvironment, check_environment, move_aside
from storage.disk.records import Databases, FormatMismatch, load_capacity, open_databases, store_capacity

log = logging.getLogger(__name__)

_MAP_FLOOR = 1 << 30
_CHUNK = 512                     # keys per read transaction when iterating a whole database


def open_env(path: str, map_size: int, readonly: bool) -> tuple[lmdb.Environment, Databases]:
    """Check the files before mapping them (a truncated file would SIGBUS on the first read past
    its end), then open the environment and our databases."""
    meta = check_environment(path)
    if meta is not None:
        # Never map less than the file's own map size: another process may have grown it. A
        # reader maps exactly that (it writes nothing, so it needs no room to grow).
        map_size = meta.map_size if readonly else max(map_size, meta.map_size)
    os.makedirs(path, exist_ok=True)
    # lock=True (the default) is what lets several processes share the directory. readahead=True:
    # a stored block is one run of contiguous overflow pages (~0.1-1 MB), read whole; with
    # readahead off (MADV_RANDOM) a cold read faulted it in 4 KiB at a time -- a burst of two
    # 2048-token restores from a cold page cache took 1.1-1.4 s instead of 0.18-0.42 s.
    env = lmdb.open(path, map_size=map_size, max_dbs=4, readonly=readonly, readahead=True, max_readers=512)
    try:
        # NOTE: before any read through the map -- a damaged page pointer past the file's end
        # makes LMDB's first read of it a SIGBUS (storage/disk/pagewalk.py).
        check_pages(env, path)
        return env, open_databases(env, path, readonly)
    except BaseException:
        env.close()
        raise


def default_map_size(capacity_bytes: int) -> int:
    """LMDB's address-space reservation: a generous multiple of the capacity (the file is
    sparse and grows only as pages are written), with a floor for small capacities. Page
    rounding of values and copy-on-write pages need room beyond the payload bytes."""
    return max(4 * capacity_bytes, _MAP_FLOOR)


def open_for_writing(path: str, map_size: int, capacity_bytes: int) -> tuple[lmdb.Environment, Databases, str | None]:
    """A writer's environment, its capacity set: (env, dbs, None), or, when the one there is
    damaged, foreign or of another format, (a fresh one, dbs, where and why the old one was moved
    aside). The caller holds the directory's open lock (storage/disk/preflight.opening)."""
    recovered = None
    try:
        env, dbs = open_env(path, map_size, readonly=False)
    except (DamagedEnvironment, FormatMismatch, lmdb.Error) as e:
        # NOTE: a damaged or foreign environment is never served from and never crashes the
        # process: it is moved aside (kept for a post-mortem) and a fresh tier starts. Loud in
        # the log, and in stats().recovered.
        aside = move_aside(path, f"{type(e).__name__}: {e}")
        log.error("disk tier %s is unusable (%s): moved aside to %s; starting an empty disk tier", path, e, aside)
        env, dbs = open_env(path, map_size, readonly=False)
        recovered = f"moved aside to {aside}: {e}"
    _set_capacity(env, dbs, path, capacity_bytes)
    return env, dbs, recovered


def _set_capacity(env: lmdb.Environment, dbs: Databases, path: str, capacity_bytes: int) -> None:
    """Store this process's capacity in `info`: every process sharing the directory enforces it."""
    with env.begin(write=True) as txn:       # at open, before any other thread exists
        before = load_capacity(txn, dbs)
        store_capacity(txn, dbs, capacity_bytes)
    if before is not None and before != capacity_bytes:
        log.warning("disk tier %s: capacity changed from %d to %d bytes by this process; every process "
                    "sharing the directory now bounds it at %d (blocks beyond it are evicted, LRU first)",
                    path, before, capacity_bytes, capacity_bytes)


class EnvGate:
    """Every transaction of this process on one environment (any thread). A transaction must
    never open another one."""

    def __init__(self, env: lmdb.Environment, path: str) -> None:
        self._env = env
        self._path = path
        self._cond = threading.Condition()          # guards _stopping, _in_txn and _resizing
        self._stopping = False
        self._in_txn = 0                            # this process's open transactions (any thread)
        self._resizing = False                      # a thread is adopting a map another process grew

    @contextlib.contextmanager
    def begin(self, **kw: object) -> Iterator[lmdb.Transaction]:
        """Every transaction of this process (reads, deletes, the writer's commits) goes through
        here. close() and a map resize wait until none is open, since both unmap the file that
        buffers=True reads hold views into. A transaction must never open another one.

        Another process may grow the map (it opened with a larger capacity): LMDB then refuses
        our next transaction with MAP_RESIZED until this process adopts the new size, which
        is only safe while no transaction of ours is open (item 5 of issue 7)."""
        for attempt in range(3):
            with self._cond:
                while self._resizing:
                    self._cond.wait()
                if self._stopping:
                    raise RuntimeError("DiskTier is closed")
                self._in_txn += 1
            try:
                try:
                    txn = self._env.begin(**kw)
                except lmdb.MapResizedError:
                    if attempt == 2:
                        raise
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            finally:
                with self._cond:
                    self._in_txn -= 1
                    self._cond.notify_all()
            self._adopt_map_size()

    def _adopt_map_size(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._in_txn:
                self._cond.wait()
        try:
            self._env.set_mapsize(0)   # 0: take the size another process set
            log.warning("disk tier %s: another process grew the map; now %d bytes", self._path,
                        self._env.info()["map_size"])
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()

    def iter_db(self, db: object, values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        """Every (key, value) of `db` in key order, read _CHUNK keys per transaction, so no read
        transaction stays open long (a long one pins old pages against reuse)."""
        last = None
        while True:
            with self.begin() as txn:
                cur = txn.cursor(db=db)
                ok = cur.first() if last is None else cur.set_range(last + b"\x00")
                rows = []
                while ok and len(rows) < _CHUNK:
                    rows.append((cur.key(), cur.value() if values else None))
                    ok = cur.next()
            yield from rows
            if not ok:
                return
            last = rows[-1][0]

    def close(self) -> None:
        """Refuse new transactions, wait until none is open, and close the environment.
        NOTE: never unmap the environment under a get_many's decode."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            while self._in_txn:
                self._cond.wait()
        self._env.close()
