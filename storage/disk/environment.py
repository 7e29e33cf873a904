"""The disk tier's LMDB environment opened: only after its files were checked, damaged ones moved
aside, and a directory that cannot hold one (full, read-only, not ours to write) a DiskUnavailable,
never a server that cannot start.

Knows: how the environment is opened (free space checked before anything is mapped -- LMDB
creating its lock file on a full filesystem dies of SIGBUS --, meta pages checked before mapping
-- a truncated file would SIGBUS --, every page pointer walked before LMDB follows one, then our
databases opened and their counters and LRU index made to agree with the blocks), the map size
to reserve, and which environments are closed and which abandoned (release).
Doesn't know: blocks, the codec or what is cached (storage/disk/tier.py, storage/disk/records.py);
the transactions on an open environment (storage/disk/gate.py); what an error means
(storage/disk/verdicts.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import lmdb

from storage.disk.map_faults import MapWatch
from storage.disk.pagewalk import check_pages
from storage.disk.preflight import DamagedEnvironment, check_environment, move_aside, opening
from storage.disk.records import (Databases, FormatMismatch, StoreDamaged, load_capacity, open_databases,
                                  repair_counters, store_capacity)
from storage.disk.verdicts import LOW_SPACE_BYTES, DAMAGE_ERRORS, free_bytes, is_damage, is_no_space, is_unwritable

__all__ = ["DAMAGE_ERRORS", "LOW_SPACE_BYTES", "DiskUnavailable", "Opened", "StoreDamaged",
           "default_map_size", "free_bytes", "is_damage", "is_no_space", "is_unwritable", "open_env",
           "open_for_writing", "open_writable", "reserve_lock_file"]

log = logging.getLogger(__name__)

_MAP_FLOOR = 1 << 30
_MAX_READERS = 512
# lock.mdb's size: LMDB's header and 64 bytes per reader slot (512 of them), with room to spare.
LOCK_FILE_BYTES = 64 << 10
# What a new environment needs free before LMDB creates it: its first pages and a margin.
OPEN_SPACE_BYTES = 1 << 20


class DiskUnavailable(OSError):
    """The disk tier cannot be opened or used at all now (a full filesystem, a store that cannot
    be created): the cache runs without it, and status says why. An OSError, so every read path
    already takes it as a miss."""


def reserve_lock_file(path: str, lock_name: str = "lock.mdb") -> None:
    """Before LMDB opens `path`: make its lock file's pages real. LMDB writes its reader table
    through a shared map of lock.mdb, which it only ftruncates: on a full filesystem the first
    write into a page that was never allocated is a SIGBUS, at start (issue 17). Allocating the
    file here turns that into ENOSPC, raised as DiskUnavailable. A larger file is fine: LMDB then
    takes its reader count from the size. Also refuses a new environment on a filesystem without
    room for its first pages."""
    os.makedirs(path, mode=0o700, exist_ok=True)      # a new store's directory: this user's alone
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
    env = lmdb.open(path, map_size=map_size, max_dbs=5, readonly=readonly, readahead=True, max_readers=_MAX_READERS)
    try:
        # NOTE: before any read through the map -- a damaged page pointer past the file's end
        # makes LMDB's first read of it a SIGBUS (storage/disk/pagewalk.py). A file truncated
        # meanwhile reads as zeros, and the open fails as damage (storage/disk/map_faults.py).
        with MapWatch(path):
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
                with MapWatch(path):      # _prepare reads every block's record through the map
                    return Opened(env, dbs, _prepare(env, dbs, path, capacity_bytes))
            except BaseException as e:
                release(env, e)
                raise
        except (DamagedEnvironment, FormatMismatch, lmdb.Error, OSError) as e:
            if isinstance(e, DiskUnavailable):
                raise
            if not is_damage(e) and is_no_space(e, path):
                # A full filesystem is not damage: the store stays, the tier waits out this process.
                raise DiskUnavailable(f"{path}: the filesystem is full ({type(e).__name__}: {e})") from e
            if not is_damage(e) and (is_unwritable(e) or isinstance(e, OSError)):
                # Nor is a directory this process may not write (read-only, permissions): no tier.
                raise DiskUnavailable(f"{path}: not writable ({type(e).__name__}: {e})") from e
            reason = f"{type(e).__name__}: {e}"
    # NOTE: a damaged or foreign environment is never served from and never crashes the process:
    # it is moved aside (kept for a post-mortem) and a fresh tier starts. Loud in the log, and in
    # stats().recovered / moved_aside.
    try:
        aside = move_aside(path, reason) if os.path.exists(path) else None
    except OSError as e:
        raise DiskUnavailable(f"{path}: unusable ({reason}) and it cannot be moved aside ({e})") from e
    log.error("disk tier %s is unusable (%s): moved aside to %s; starting an empty disk tier", path, reason, aside)
    try:
        env, dbs = open_env(path, map_size, readonly=False)
        with MapWatch(path):
            hashes = _prepare(env, dbs, path, capacity_bytes)
    except DiskUnavailable:
        raise
    except (OSError, lmdb.Error) as e:
        raise DiskUnavailable(f"{path}: a fresh disk tier cannot be created ({type(e).__name__}: {e})") from e
    return Opened(env, dbs, hashes, f"moved aside to {aside}: {reason}")


def open_writable(path: str, map_size: int, capacity_bytes: int, reason: str | None = None,
                  theirs: Callable[[], bool] = lambda: False) -> Opened:
    """open_for_writing under the directory's open lock (storage/disk/preflight.opening). A
    directory this process cannot write -- a read-only filesystem, no permission, a parent that
    is a file -- raises DiskUnavailable: the cache runs without the tier (issue 28, item 4).
    `theirs()`, asked under the lock: another process sharing the directory replaced the store
    already, so this one is taken as it is, not moved aside for `reason`."""
    try:
        with opening(path):
            return open_for_writing(path, map_size, capacity_bytes, None if theirs() else reason)
    except DiskUnavailable:
        raise
    except OSError as e:
        raise DiskUnavailable(f"{path}: the disk tier's directory is not writable ({e})") from e


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
