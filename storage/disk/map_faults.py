"""A store's maps made safe to touch: a page that data.mdb (or lock.mdb) no longer backs -- the file
was truncated under the map -- reads as zeros instead of a SIGBUS that kills the process, and the
store is then damage (moved aside, storage/disk/replacement.py), never served.

Knows: which stores this process watches (`MapWatch`: the (device, inode) of their data.mdb and
lock.mdb, as /proc/self/maps prints them), how many faults the compiled handler absorbed in their
maps since each watch began, and that any is damage (`FileChanged`). The handler itself is
storage/disk/_map_faults.c (built by `pip install`, like the codec's byte planes).
Doesn't know: LMDB or what reads what -- storage/disk/gate.py checks a watch before and after every
transaction, storage/disk/environment.py while it opens one.

Why this and not another way to close issue 28's window (a truncate landing inside a transaction,
after the files' check of storage/disk/liveness.py):
- (a) reads by pread of our own B-tree walk, with a read transaction pinning the snapshot: covers
  the reads only. The writer's commits walk LMDB's tree through the map in this process too, and
  mdb_txn_begin reads the meta pages through it: a truncate there still killed the process.
- (b) the map-touching reads in a reader child process: the same gap for the writer and every
  other transaction, and a pipe or shared-memory hop added to every disk hit.
- (c) this: one handler for every touch of the map by anything in the process (LMDB's tree walks,
  txn begin's meta pages, our copies, the writer's commits, stats), at no cost on any read path --
  nothing runs until a fault. It never unwinds (no longjmp through LMDB or the interpreter: a fault
  in a memcpy holding the GIL finishes that memcpy); it maps anonymous zero pages over the part of
  the mapping past the fault and lets the instruction run again. Zeros are the safest filler: a
  zero page is neither a branch nor a leaf to LMDB (MDB_CORRUPTED, never a pointer followed), and a
  payload read as zeros fails its checksums. Every transaction that overlapped the fault, and every
  one after it on that store, fails its watch check (FileChanged: damage): its results are thrown
  away -- a read is a miss, a write batch is aborted before its commit and retried on the fresh
  store -- and the gate replaces the store.
- Faults that are not in a watched file's map (another library's, a kill -BUS) go to the handler
  that was there before, which is put back first (faulthandler's stacks, then the default death).

NOTE what stays open: without the compiled module (no C compiler at install) nothing is
absorbed -- the tier works as before, with the residual window, and says so once in the log. A
SIGBUS handler installed after a store was opened (faulthandler.enable() late) comes first until
the next store is opened (MapWatch reinstalls ours). lock.mdb's map is watched too, but zeros in
place of the reader table lose this process's reader slots and lock state: the store is replaced
at once, and a thread that held LMDB's write mutex in the zeroed page unlocks a lock nobody else
sees (a second write transaction of this process may then run beside it on the damaged store,
until the replacement). Linux only (/proc/self/maps): elsewhere the module is not built.

Threads: a MapWatch is created and closed by the gate's owner (no transaction open); faults() is
read by any thread (atomic counters in the C module).
"""
from __future__ import annotations

import logging
import os

from storage.disk.liveness import FileChanged

try:
    from storage.disk import _map_faults as _compiled
except ImportError:      # no C compiler at install: unprotected, as before (said once)
    _compiled = None

__all__ = ["FileChanged", "MapWatch", "PROTECTED", "absorbed"]

log = logging.getLogger(__name__)

PROTECTED = _compiled is not None
_WATCHED = ("data.mdb", "lock.mdb")
_warned = False


def _identities(path: str) -> set[tuple[int, int, int]]:
    """(major, minor, inode) of `path` as /proc/self/maps prints its mappings (a filesystem may
    print another device there than stat's: overlayfs, btrfs subvolumes), else as stat says."""
    st = os.stat(path)
    name = "/" + os.path.basename(path)
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and int(fields[4]) == st.st_ino and name in fields[5]:
                    major, minor = fields[3].split(":")
                    found.add((int(major, 16), int(minor, 16), st.st_ino))
    except (OSError, ValueError):
        pass
    return found or {(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)}


def absorbed() -> int:
    """Faults absorbed in this process so far, every watched store together (0 without the module)."""
    return _compiled.absorbed() if _compiled is not None else 0


class MapWatch:
    """The faults absorbed in the maps of one store's files since this watch began. Open it once
    LMDB has mapped the files (after lmdb.open); close it when done (the gate: at a replacement
    and at close). A context manager: its exit checks, so a fault inside is FileChanged."""

    def __init__(self, path: str) -> None:
        global _warned
        self.path = path
        self._slots: list[tuple[int, int]] = []     # (slot, faults when the watch began)
        self._absorbed = 0                            # every slot's faults together, then
        if _compiled is None:
            if not _warned:
                _warned = True
                log.warning("disk tier: storage/disk/_map_faults.c is not built (no C compiler at install?): a "
                            "data.mdb truncated during a transaction kills the process (SIGBUS)")
            return
        _compiled.install()
        for name in _WATCHED:
            try:
                idents = _identities(os.path.join(path, name))
            except OSError:
                continue                              # not there (yet): nothing of it is mapped
            for ident in idents:
                slot = _compiled.watch(*ident)
                if slot < 0:
                    log.warning("disk tier %s: too many stores watched; %s is not", path, name)
                    continue
                self._slots.append((slot, _compiled.faults(slot)))
        self._absorbed = absorbed()

    @property
    def watching(self) -> bool:
        return bool(self._slots)

    def faults(self) -> int:
        """Faults absorbed in the store's maps since the watch began (any thread's)."""
        return sum(_compiled.faults(slot) - base for slot, base in self._slots)

    def damage(self) -> FileChanged | None:
        # NOTE: the fast path of every transaction (twice): one call, no fault anywhere since.
        if not self._slots or _compiled.absorbed() == self._absorbed:
            return None
        n = self.faults()
        if not n:
            return None
        return FileChanged(f"{self.path}: {n} read(s) of its map past the end of a file were absorbed as zeros "
                           "(data.mdb or lock.mdb shrank during a transaction)")

    def check(self) -> None:
        """Raise FileChanged when any fault was absorbed: nothing read from the map is trusted."""
        e = self.damage()
        if e is not None:
            raise e

    def close(self) -> None:
        """Stop watching (idempotent). Before the environment's map is gone or abandoned."""
        slots, self._slots = self._slots, []
        for slot, _ in slots:
            _compiled.unwatch(slot)

    def __enter__(self) -> "MapWatch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            e = self.damage()
            if e is not None:            # whatever the zeros made the code inside raise, it is this
                raise e from exc
        finally:
            self.close()
