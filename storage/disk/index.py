"""The disk tier's in-memory index: which block hashes this process knows are stored.

Knows: a set of hashes, loaded from the `meta` database at open and kept up to date by this
process's commits, evictions and deletes, so `DiskTier.contains()` -- asked for every block of
every waiting request on every engine step -- never reads LMDB. Thread-safe (one lock, never
held across I/O): the writer thread adds and removes after its commits; reader threads remove
what they found gone.
Doesn't know: other processes. A block another process stores is not here until this one
reopens (a missed hit, never a wrong byte); one another process evicts is found gone at the
read, which counts a miss and forgets it here.
"""
from __future__ import annotations

import threading
from typing import Iterable


class DiskIndex:
    def __init__(self, hashes: Iterable[bytes] = ()) -> None:
        self._lock = threading.Lock()
        self._hashes: set[bytes] = set(hashes)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._hashes

    def __len__(self) -> int:
        with self._lock:
            return len(self._hashes)

    def add(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._hashes.update(hashes)

    def discard(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._hashes.difference_update(hashes)

    def clear(self) -> None:
        with self._lock:
            self._hashes.clear()
