"""LMDB's lock file made writable in this process's map before LMDB stores into it, by a store of
our own with the GIL released, so that a frozen filesystem holds one thread and not the
interpreter (issue 44, item 3).

Why: py-lmdb calls mdb_txn_begin for a read transaction, mdb_txn_reset/abort at its end (and at
its dealloc) and mdb_reader_check with the GIL held (lmdb/cpython.c: "hold GIL ... issue #180"),
and each of them stores into the reader table, a MAP_SHARED map of lock.mdb. Once a page of that
map was written back (by the kernel's flusher, and by the syncs a freeze makes) the next store
faults, and on a frozen filesystem ext4_page_mkwrite waits, uninterruptibly, until the thaw: with
the GIL held, every thread of the process waits behind it -- the event loop, /health, the engine
(py-spy: the status thread in EnvGate.begin in `D` state in percpu_rwsem_wait under
ext4_page_mkwrite, every other thread waiting for the GIL). Write transactions are not at risk:
py-lmdb begins and commits them with the GIL released.

Knows: where lock.mdb is mapped in this process (/proc/self/maps, by inode), and how to make those
pages writable without the GIL: a store into each that changes nothing (storage/disk/_lock_touch.c:
the kernel's write fault taken, ext4's page_mkwrite included; a few us when they are writable
already; not madvise(MADV_POPULATE_WRITE), which waits holding the process's mmap lock, so that
every malloc of the process waits with it). One touch at a time, each registered in the StallWatch
as a "lock" call. Two ways to wait for one:
- `touch_here`: the calling thread touches (the reads' path: a few us). On a frozen filesystem
  the first caller waits in the kernel, GIL released, until the thaw; the others wait for it at
  most their bound, and once it has waited past the stall bound are refused at once (DiskStalled).
- `touch`: handed to `tieredkv-disk-touch` and waited for at most the caller's bound (what must
  answer even then: status): the caller never waits in the kernel itself.
`on_touched` runs right after each touch, still holding the turn (the gate ends and frees the
transactions it had to leave: storage/disk/gate.py).
Doesn't know: LMDB's layout of the lock file or which store a page is (every page of the map is
touched), transactions.

NOTE what stays open: a page written back between a touch and LMDB's store -- a freeze's last
sync landing in those microseconds (touch_here), or in the handed-over touch's wake-up (touch, a
rarer path) -- still holds the GIL until the thaw. Before Linux 6.7 a write fault waits in
page_mkwrite holding the process's mmap lock (since: its map's lock alone), so a touch's wait soon
holds every thread that maps memory: the process stops as before. Without the compiled module (no
C compiler at install) or /proc/self/maps nothing is touched and a frozen filesystem holds the
process as before: said once in the log.

Threads: `touch`/`touch_here` from any thread; the map is read once (the gate makes a new
LockPages for a new store); close() before the map goes.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from storage.disk.stall import DiskStalled, StallWatch

try:
    from storage.disk import _lock_touch
except ImportError:      # no C compiler at install: nothing touched (said once)
    _lock_touch = None

__all__ = ["LockPages", "lock_ranges"]

log = logging.getLogger(__name__)

_warned = False


def lock_ranges(path: str) -> list[tuple[int, int]]:
    """(address, length) of every shared writable map of the file `path` in this process."""
    try:
        ino = os.stat(path).st_ino
        name = "/" + os.path.basename(path)
        found = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if (len(fields) == 6 and int(fields[4]) == ino and fields[5].rstrip("\n").endswith(name)
                        and fields[1].startswith("rw") and fields[1][3] == "s"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    found.append((lo, hi - lo))
        return found
    except (OSError, ValueError):
        return []


class LockPages:
    def __init__(self, lock_file: str, stall: StallWatch, on_touched: Callable[[], None] | None = None) -> None:
        global _warned
        self._stall = stall
        self.on_touched = on_touched
        self._ranges = lock_ranges(lock_file) if _lock_touch is not None else []
        if not self._ranges and not _warned:
            _warned = True
            log.warning("disk tier: LMDB's lock file cannot be made writable ahead of LMDB (%s): a frozen "
                        "filesystem under the disk tier holds the whole process until it thaws",
                        "storage/disk/_lock_touch.c is not built (no C compiler at install?)" if _lock_touch is None
                        else f"no shared map of {lock_file} found")
        self._turn = threading.Lock()          # one touch at a time (one waiting in the kernel holds it)
        self._cond = threading.Condition()     # guards _asked, _done, _closed, _thread
        self._asked = 0                        # touches asked of the thread ...
        self._done = 0                         # ... and done (one done covers every one asked before it began)
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether anything is touched (else the gate ends its transactions as py-lmdb would)."""
        return bool(self._ranges)

    def touch_here(self, wait: float) -> None:
        """Touch on this thread, once no other touch is under way (waited for at most `wait` s,
        else DiskStalled); DiskStalled at once while a touch has been waiting past the stall bound."""
        if not self._ranges:
            return
        self._stall.check(reads=True)
        if not self._turn.acquire(timeout=wait):
            raise self._stalled(wait)
        try:
            self._touch()
        finally:
            self._turn.release()

    def touch(self, wait: float) -> None:
        """Return once a touch that began after this call did is done (the caller's next store
        into the pages faults no more); DiskStalled when that took more than `wait` seconds, or at
        once while a touch has been waiting past the stall bound. This thread never touches."""
        if not self._ranges:
            return
        self._stall.check(reads=True)
        with self._cond:
            if self._closed:
                raise DiskStalled(f"{self._stall.path}: the disk tier is closing")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tieredkv-disk-touch", daemon=True)
                self._thread.start()
            self._asked += 1
            mine = self._asked
            self._cond.notify_all()
            if self._cond.wait_for(lambda: self._done >= mine, wait):
                return
        raise self._stalled(wait)

    def _stalled(self, wait: float) -> DiskStalled:
        return DiskStalled(f"{self._stall.path}: LMDB's lock file has not been writable for {wait:.1f} s "
                           "(the filesystem frozen or hung)")

    def _touch(self) -> None:
        """Holding the turn: every page of the map written, then on_touched."""
        with self._stall.op("lock", "making LMDB's lock file writable"):
            for addr, length in self._ranges:
                _lock_touch.touch(addr, length)     # NOTE: the GIL released; waits as long as the filesystem does
        if self.on_touched is not None:
            try:
                self.on_touched()
            except Exception:      # noqa: BLE001 -- the touches go on
                log.exception("disk tier %s: after a touch of the lock file", self._stall.path)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._done or self._closed)
                if self._closed:
                    return
                target = self._asked
            while not self._turn.acquire(timeout=0.1):
                if self._closed:
                    return
            try:
                self._touch()
            finally:
                self._turn.release()
            with self._cond:
                self._done = target
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Stop the thread; False when a touch is still waiting in the kernel after `timeout` (the
        map must then be left mapped: the caller abandons the environment)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        if not self._turn.acquire(timeout=timeout):      # a touch_here still in the kernel
            return False
        self._turn.release()
        return True
