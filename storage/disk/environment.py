"""The disk tier's LMDB environment as one process holds it: opened only after its files were
checked, every transaction of the process counted, and every LMDB error that says the store is
damaged turned into one verdict: the store is moved aside and a fresh one takes its place.

Knows: how the environment is opened (free space checked before anything is mapped -- LMDB
creating its lock file on a full filesystem dies of SIGBUS --, meta pages checked before mapping
-- a truncated file would SIGBUS --, every page pointer walked before LMDB follows one, then our
databases opened and their counters and LRU index made to agree with the blocks), the map size
to reserve, and the gate every transaction goes through: close(), the adoption of a map another
process grew (LMDB's MAP_RESIZED) and the replacement of a damaged store wait until no
transaction of this process is open, since buffers=True reads hold views into the map.
Doesn't know: blocks, the codec or what is cached (storage/disk/tier.py, storage/disk/records.py).

NOTE invariant (issue 17): an LMDB error is a verdict on the store, never a loop or a dead
process. Every transaction goes through EnvGate.begin; an error of DAMAGE_ERRORS raised in one
(at begin, inside, or at commit) is reported to the gate's `on_damage` once the transaction is
closed, and the tier replaces the store (DiskTier._replace_damaged). The caller still sees the
error, and turns it into what it always does: a miss, or a batch retried on the fresh store.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import lmdb

from storage.disk.pagewalk import check_pages
from storage.disk.preflight import DamagedEnvironment, check_environment, move_aside
from storage.disk.records import (Databases, FormatMismatch, StoreDamaged, load_capacity, open_databases,
                                  repair_counters, store_capacity)

__all__ = ["DAMAGE_ERRORS", "DiskUnavailable", "EnvGate", "Opened", "StoreDamaged", "default_map_size",
           "free_bytes", "is_damage", "is_no_space", "open_env", "open_for_writing", "reserve_lock_file"]

log = logging.getLogger(__name__)

_MAP_FLOOR = 1 << 30
_CHUNK = 512                     # keys per read transaction when iterating a whole database
_MAX_READERS = 512
# lock.mdb's size: LMDB's header and 64 bytes per reader slot (512 of them), with room to spare.
LOCK_FILE_BYTES = 64 << 10
# What a new environment needs free before LMDB creates it: its first pages and a margin.
OPEN_SPACE_BYTES = 1 << 20
# Below this much free space, an EIO at commit is taken as "disk full".
LOW_SPACE_BYTES = 1 << 20


class DiskUnavailable(OSError):
    """The disk tier cannot be opened or used at all now (a full filesystem, a store that cannot
    be created): the cache runs without it, and status says why. An OSError, so every read path
    already takes it as a miss."""


# The errors that mean the store itself is damaged: LMDB's MDB_CORRUPTED, MDB_PAGE_NOTFOUND,
# MDB_PANIC (the environment had a fatal error and must be reopened), MDB_INVALID, MDB_INCOMPATIBLE
# (our databases never change their flags: a node flag flipped says "dup-sorted" -- fault drill),
# and ours.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
                                                  lmdb.InvalidError, lmdb.IncompatibleError, DamagedEnvironment)


def is_damage(e: BaseException) -> bool:
    return isinstance(e, DAMAGE_ERRORS)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or its
    nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def is_no_space(e: BaseException, path: str) -> bool:
    """Whether an error means the filesystem (or the map) is full. lmdb.DiskError is LMDB's
    ENOSPC; an OSError may carry it too. A full filesystem can also show up as EIO from a short
    write at commit: then the filesystem's free space decides."""
    if isinstance(e, (lmdb.MapFullError, lmdb.DiskError)) or getattr(e, "errno", None) == errno.ENOSPC:
        return True
    if isinstance(e, (lmdb.Error, OSError)) and ("Input/output error" in str(e) or "No space" in str(e)):
        try:
            return free_bytes(path) < LOW_SPACE_BYTES
        except OSError:
            return False
    return False


def data_file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of `path`/data.mdb, or None when there is none: how a process sharing the
    directory sees that another one moved the store aside and started a fresh one."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def reserve_lock_file(path: str, lock_name: str = "lock.mdb") -> None:
    """Before LMDB opens `path`: make its lock file's pages real. LMDB writes its reader table
    through a shared map of lock.mdb, which it only ftruncates: on a full filesystem the first
    write into a page that was never allocated is a SIGBUS, at start (issue 17). Allocating the
    file here turns that into ENOSPC, raised as DiskUnavailable. A larger file is fine: LMDB then
    takes its reader count from the size. Also refuses a new environment on a filesystem without
    room for its first pages."""
    os.makedirs(path, exist_ok=True)
    try:
        if not os.path.exists(os.path.join(path, "data.mdb")) and free_bytes(path) < OPEN_SPACE_BYTES:
            raise DiskUnavailable(f"{path}: the filesystem is full ({free_bytes(path)} bytes free; a new store "
                                  f"needs {OPEN_SPACE_BYTES})")
        fd = os.open(os.path.join(path, lock_name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
        finally:
            os.close(fd)
    except DiskUnavailable:
        raise
    except OSError as e:
        raise DiskUnavailable(f"{path}: cannot prepare {lock_name} ({e.strerror or e}): the filesystem is full "
                              "or not writable") from e


def open_env(path: str, map_size: int, readonly: bool) -> tuple[lmdb.Environment, Databases]:
    """Check the files before mapping them (a truncated file would SIGBUS on the first read past
    its end), then open the environment and our databases."""
    meta = check_environment(path)
    if meta is not None:
        # Never map less than the file's own map size: another process may have grown it. A
        # reader maps exactly that (it writes nothing, so it needs no room to grow).
        map_size = meta.map_size if readonly else max(map_size, meta.map_size)
    if not readonly:
        reserve_lock_file(path)     # NOTE: before LMDB maps lock.mdb (a full filesystem: SIGBUS)
    # lock=True (the default) is what lets several processes share the directory. readahead=True:
    # a stored block is one run of contiguous overflow pages (~0.1-1 MB), read whole; with
    # readahead off (MADV_RANDOM) a cold read faulted it in 4 KiB at a time -- a burst of two
    # 2048-token restores from a cold page cache took 1.1-1.4 s instead of 0.18-0.42 s.
    env = lmdb.open(path, map_size=map_size, max_dbs=4, readonly=readonly, readahead=True, max_readers=_MAX_READERS)
    try:
        # NOTE: before any read through the map -- a damaged page pointer past the file's end
        # makes LMDB's first read of it a SIGBUS (storage/disk/pagewalk.py).
        check_pages(env, path)
        return env, open_databases(env, path, readonly)
    except BaseException as e:
        release(env, e)
        raise


def default_map_size(capacity_bytes: int) -> int:
    """LMDB's address-space reservation: a generous multiple of the capacity (the file is
    sparse and grows only as pages are written), with a floor for small capacities. Page
    rounding of values and copy-on-write pages need room beyond the payload bytes."""
    return max(4 * capacity_bytes, _MAP_FLOOR)


@dataclass(slots=True)
class Opened:
    """A writer's environment, ready: its databases, the hashes it stores, and whether a damaged
    one was moved aside to get it (where, and why)."""
    env: lmdb.Environment
    dbs: Databases
    hashes: list[bytes]
    recovered: str | None = None


def open_for_writing(path: str, map_size: int, capacity_bytes: int, reason: str | None = None) -> Opened:
    """A writer's environment, its capacity set and its counters and LRU index checked against
    its blocks. When the one there is damaged, foreign or of another format -- or `reason` says
    the running process found it damaged -- it is moved aside and a fresh one is opened. The
    caller holds the directory's open lock (storage/disk/preflight.opening). Raises
    DiskUnavailable when no environment can be had (a full filesystem)."""
    if reason is None:
        try:
            env, dbs = open_env(path, map_size, readonly=False)
            try:
                return Opened(env, dbs, _prepare(env, dbs, path, capacity_bytes))
            except BaseException as e:
                release(env, e)
                raise
        except (DamagedEnvironment, FormatMismatch, lmdb.Error) as e:
            if not is_damage(e) and is_no_space(e, path):
                # A full filesystem is not damage: the store stays, the tier waits out this process.
                raise DiskUnavailable(f"{path}: the filesystem is full ({type(e).__name__}: {e})") from e
            reason = f"{type(e).__name__}: {e}"
    # NOTE: a damaged or foreign environment is never served from and never crashes the process:
    # it is moved aside (kept for a post-mortem) and a fresh tier starts. Loud in the log, and in
    # stats().recovered / moved_aside.
    aside = move_aside(path, reason) if os.path.exists(path) else None
    log.error("disk tier %s is unusable (%s): moved aside to %s; starting an empty disk tier", path, reason, aside)
    try:
        env, dbs = open_env(path, map_size, readonly=False)
        hashes = _prepare(env, dbs, path, capacity_bytes)
    except DiskUnavailable:
        raise
    except (OSError, lmdb.Error) as e:
        raise DiskUnavailable(f"{path}: a fresh disk tier cannot be created ({type(e).__name__}: {e})") from e
    return Opened(env, dbs, hashes, f"moved aside to {aside}: {reason}")


def _prepare(env: lmdb.Environment, dbs: Databases, path: str, capacity_bytes: int) -> list[bytes]:
    """At open, in one write transaction: store this process's capacity in `info` (every process
    sharing the directory enforces it), and make the counters and the LRU index agree with the
    blocks (records.repair_counters: wrong counters would hold the store over its capacity or
    evict too early). Returns every stored hash (the tier's index). Before any other thread."""
    with env.begin(write=True) as txn:    # writes nothing when all is in order (a full disk opens)
        before = load_capacity(txn, dbs)
        if before != capacity_bytes:
            store_capacity(txn, dbs, capacity_bytes)
        hashes, fixed = repair_counters(txn, dbs)
    if fixed:
        log.warning("disk tier %s: %s; corrected at open", path, "; ".join(fixed))
    if before is not None and before != capacity_bytes:
        log.warning("disk tier %s: capacity changed from %d to %d bytes by this process; every process "
                    "sharing the directory now bounds it at %d (blocks beyond it are evicted, LRU first)",
                    path, before, capacity_bytes, capacity_bytes)
    return hashes


_ABANDONED: list[lmdb.Environment] = []     # damaged environments never closed (release, EnvGate.replace)


def release(env: lmdb.Environment, e: BaseException) -> None:
    """Close an environment that failed to open -- unless LMDB itself found it damaged: then
    abandon it. NOTE: an LMDB operation on a damaged page can corrupt LMDB's own memory, and its
    close then aborts the process on a double free (fault drill, lru leaf). Kept referenced (py-lmdb
    closes on collection): a map's address space and a file descriptor per damaged store, once.
    Our own checks (the page walk, the databases' presence) refuse before LMDB touches a damaged
    page: those environments are closed."""
    if isinstance(e, lmdb.Error) and is_damage(e):
        _ABANDONED.append(env)
    else:
        env.close()


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
        self.file_id = data_file_id(path)           # (device, inode) of the data.mdb this gate maps
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
            except DAMAGE_ERRORS as e:
                damage = e
                raise
            finally:
                with self._cond:
                    self._in_txn -= 1
                    self._cond.notify_all()
                if damage is not None:
                    self._report(damage, generation)
            self._adopt_map_size()

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

    def _adopt_map_size(self) -> None:
        self._exclusive()
        try:
            self._env.set_mapsize(0)   # 0: take the size another process set
            log.warning("disk tier %s: another process grew the map; now %d bytes", self._path,
                        self._env.info()["map_size"])
        finally:
            self._release()

    def set_map_size(self, size: int) -> int:
        """Map (and so bound the data file at) `size` bytes, with no transaction open; LMDB rounds
        a size below the pages in use up to them. Returns the size now mapped."""
        self._exclusive()
        try:
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
            if damaged:
                _ABANDONED.append(self._env)
            else:
                self._env.close()
            try:
                self._env, self.dbs = reopen()
            except BaseException as e:
                self._down = f"{self._path}: no usable store ({type(e).__name__}: {e})"
                raise
            self.generation += 1
            self.file_id = data_file_id(self._path)
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
        if self._down is None:          # a tier that went down abandoned its damaged environment
            self._env.close()
