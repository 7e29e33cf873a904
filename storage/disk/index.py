"""The disk tier's in-memory index: which block hashes this process knows are stored.

Knows: a set of hashes, loaded from the `meta` database at open and kept up to date by this
process's commits, evictions and deletes, so `DiskTier.contains()` -- asked for every block of
every waiting request on every engine step -- never reads LMDB. Thread-safe (one lock, never
held across I/O): the writer thread adds and removes after its commits; reader threads remove
what they found gone.
Every change of what it holds is a KV event (storage/kv_events/sink.py, medium "DISK"), said under
its lock so the events' order is the index's: a committed block (`add_keys`) is BlockStored, one
evicted, deleted, found gone or cleared is BlockRemoved. Hashes added without their keys (`replace`:
a store another process made) have no BlockStored (it needs the tokens and the parent).
Doesn't know: other processes. A block another process stores is not here until this one
reopens (a missed hit, never a wrong byte); one another process evicts is found gone at the
read, which counts a miss and forgets it here.
"""
from __future__ import annotations

import threading
from typing import Iterable, Sequence

from storage.hashing import BlockKey
from storage.kv_events.sink import DISK_MEDIUM, NO_EVENTS, NoEvents


class DiskIndex:
    def __init__(self, hashes: Iterable[bytes] = ()) -> None:
        self._lock = threading.Lock()
        self._hashes: set[bytes] = set(hashes)
        self.events: NoEvents = NO_EVENTS

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._hashes

    def __len__(self) -> int:
        with self._lock:
            return len(self._hashes)

    def add_keys(self, keys: Sequence[BlockKey]) -> None:
        """Blocks just committed (their BlockStored: the ones new here)."""
        with self._lock:
            new = [k for k in keys if k.hash not in self._hashes]
            self._hashes.update(k.hash for k in new)
            self.events.stored(new, DISK_MEDIUM)

    def announce(self, keys: Sequence[BlockKey]) -> None:
        """BlockStored for the keys still held (the blocks found at open, read back with their keys)."""
        with self._lock:
            self.events.stored([k for k in keys if k.hash in self._hashes], DISK_MEDIUM)

    def add(self, hashes: Iterable[bytes]) -> None:
        """Hashes known stored, without their keys (no event)."""
        with self._lock:
            self._hashes.update(hashes)

    def discard(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            gone = [h for h in dict.fromkeys(hashes) if h in self._hashes]
            self._hashes.difference_update(gone)
            self.events.removed(gone, DISK_MEDIUM)

    def replace(self, hashes: Iterable[bytes]) -> None:
        """Hold exactly `hashes` now (a store replaced or recounted): BlockRemoved for the others."""
        with self._lock:
            new = set(hashes)
            self.events.removed([h for h in self._hashes if h not in new], DISK_MEDIUM)
            self._hashes = new

    def clear(self) -> None:
        self.replace(())
