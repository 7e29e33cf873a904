"""A disk tier whose storage calls stopped returning (issue 44, item 3): a frozen filesystem
(`fsfreeze -f`), a hung device or NFS server. Reads become misses and writes are refused while any
such call has been in flight longer than `stall_s`, and both come back by themselves the moment it
returns.

Knows: the storage calls that may wait in the kernel for as long as the filesystem does, each
registered while in flight with its kind and start (`op`): "lock" -- LMDB's lock file made
writable before a transaction stores into it (storage/disk/lock_pages.py; every read and write of
this process waits behind it) -- and "write" -- a write transaction's begin (LMDB's writer mutex)
and commit (its writes and fsync). `reason()` says why the tier is stalled now: reads are stalled
only by a "lock" call (a commit that is merely slow leaves the reads alone), writes by either. One
log line when a stall is first seen, one when it ends.
Doesn't know: LMDB, what the calls are (storage/disk/gate.py registers them), or what the tier
does while stalled (storage/disk/tier.py: puts refused and counted, contains() False, reads
misses, stats from memory).

Threads: any thread registers and asks; a small lock guards the table (never held across a call).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Iterator

from storage.disk.environment import DiskUnavailable

__all__ = ["DEFAULT_STALL_S", "DiskStalled", "StallWatch"]

log = logging.getLogger(__name__)

DEFAULT_STALL_S = 2.0      # CacheConfig.disk_stall_s


class DiskStalled(DiskUnavailable):
    """A storage call of this tier has not returned for longer than its stall bound: the caller
    takes a miss (a read) or drops its write, at once, instead of waiting with it."""


class StallWatch:
    def __init__(self, path: str, stall_s: float = DEFAULT_STALL_S) -> None:
        if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or not stall_s > 0:
            raise ValueError(f"stall_s: expected seconds > 0, got {stall_s!r}")
        self.path = path
        self.stall_s = float(stall_s)
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[str, str, float]] = {}   # id -> (kind, what, monotonic start)
        self._ids = itertools.count()
        self._said: str | None = None      # the stall logged, until it ends
        self.stalls = 0                    # stalls seen (each logged once)

    @contextlib.contextmanager
    def op(self, kind: str, what: str) -> Iterator[None]:
        """Around one call that may wait on the filesystem: `kind` "lock" or "write"."""
        n = next(self._ids)
        with self._lock:
            self._inflight[n] = (kind, what, time.monotonic())
        try:
            yield
        finally:
            said = None
            with self._lock:
                del self._inflight[n]
                if self._said is not None:
                    now = time.monotonic()
                    if not any(now - start > self.stall_s for _, _, start in self._inflight.values()):
                        said, self._said = self._said, None
            if said is not None:
                log.warning("disk tier %s: its storage calls return again (%s); reads and writes back on",
                            self.path, said)

    def reason(self, reads: bool = False) -> str | None:
        """Why the tier is stalled now, or None. reads=True: only what stalls reads (a "lock" call)."""
        if not self._inflight:            # NOTE: the engine thread asks on every contains(): no lock then
            return None
        now = time.monotonic()
        with self._lock:
            late = [(now - start, kind, what) for kind, what, start in self._inflight.values()
                    if now - start > self.stall_s and (kind == "lock" or not reads)]
            if not late:
                return None
            age, kind, what = max(late)
            why = (f"{what} has not returned for {age:.1f} s (the filesystem frozen or hung): "
                   + ("reads are misses and writes are off" if kind == "lock" else "writes are off")
                   + " until it does")
            first = self._said is None
            if first:
                self._said = what
                self.stalls += 1
        if first:
            log.warning("disk tier %s: stalled: %s", self.path, why)
        return why

    def check(self, reads: bool = False) -> None:
        """Raise DiskStalled while stalled (see reason)."""
        why = self.reason(reads)
        if why is not None:
            raise DiskStalled(f"{self.path}: {why}")
