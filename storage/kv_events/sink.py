"""The hook every tier's index calls as it changes: `events.stored(keys, medium)`,
`events.removed(hashes, medium)`; and the cache's `events.cleared()`.

Knows: a bounded queue and what did not fit in it. A call puts one small tuple on the queue and
returns (`put_nowait`: a full queue drops the call's events and counts them); nothing is encoded,
sent or waited for, so a caller may hold the tiers' lock (storage/tiers.py) and the engine thread
may call it. `NO_EVENTS` answers every call with nothing, for a cache that publishes nothing.
Doesn't know: sockets or the wire format (storage/kv_events/publisher.py drains the queue).

Media are vLLM's names for where a block is, each tier's own (storage/tier_kinds.py): "GPU" (our
device pool, even when the device is the CPU), "CPU" (the host tier), "DISK", "REMOTE".
"""
from __future__ import annotations

import queue
import threading
from typing import Sequence

from storage.hashing import BlockKey
from storage.tier_kinds import DEVICE, DISK, HOST, REMOTE

# Our tiers' media under vLLM's wire names, as each kind says it (storage/tier_kinds.py: medium_of).
DEVICE_MEDIUM, HOST_MEDIUM, DISK_MEDIUM, REMOTE_MEDIUM = DEVICE.medium, HOST.medium, DISK.medium, REMOTE.medium


class NoEvents:
    """Events off: every call does nothing."""
    enabled = False

    def stored(self, keys: Sequence[BlockKey], medium: str) -> None:
        pass

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        pass

    def cleared(self) -> None:
        pass


NO_EVENTS = NoEvents()


class EventSink(NoEvents):
    """Events on: each call is one item on a bounded queue, ("stored", medium, keys),
    ("removed", medium, hashes) or ("cleared",). Thread-safe; never blocks."""
    enabled = True

    def __init__(self, max_items: int = 65536) -> None:
        if max_items < 1:
            raise ValueError(f"max_items: expected >= 1, got {max_items}")
        self.queue: queue.Queue = queue.Queue(max_items)
        self._lock = threading.Lock()     # the drop counter only
        self._dropped = 0                 # events (blocks, or a clear) never queued

    def stored(self, keys: Sequence[BlockKey], medium: str) -> None:
        if keys:
            self._put(("stored", medium, tuple(keys)), len(keys))

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        if hashes:
            self._put(("removed", medium, tuple(hashes)), len(hashes))

    def cleared(self) -> None:
        self._put(("cleared",), 1)

    def _put(self, item: tuple, n: int) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            # NOTE: a subscriber's index then misses these blocks (no sequence gap shows it: they
            # were never numbered); `dropped` in cache_status and the metric say so.
            with self._lock:
                self._dropped += n

    def busy(self) -> bool:
        """More than a quarter of the queue is waiting: a bulk producer (the disk's announcement
        at start) waits before it adds more."""
        return self.queue.qsize() * 4 > self.queue.maxsize

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped
