"""Which blocks this process believes the store holds: the remote tier's "known present" set.

Knows: store keys this process wrote or read, each trusted until a deadline -- half the store's
TTL when writes carry one (the store forgets the block by then), else until a read or an EXISTS
misses it, or the breaker closes again after an outage (the store may have restarted empty) --,
and at most `capacity` of them (the oldest forgotten first). A known key is not sent again: a
restored block reaches the local disk, whose commit would forward it back to the store.
Doesn't know: the store, the breaker or when to ask (storage/remote/tier.py calls it).

Threads: any; every method takes `_lock` (held for no I/O).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict


class KnownKeys:
    def __init__(self, trust_s: float = float("inf"), capacity: int = 1 << 16) -> None:
        self.trust_s, self.capacity = trust_s, capacity
        self._until: OrderedDict[bytes, float] = OrderedDict()     # key -> trusted until (monotonic)
        self._lock = threading.Lock()

    def remember(self, rk: bytes) -> None:
        with self._lock:
            self._until[rk] = time.monotonic() + self.trust_s
            self._until.move_to_end(rk)
            if len(self._until) > self.capacity:
                self._until.popitem(last=False)

    def forget(self, rk: bytes) -> None:
        with self._lock:
            self._until.pop(rk, None)

    def __contains__(self, rk: bytes) -> bool:
        with self._lock:
            until = self._until.get(rk)
            if until is not None and until < time.monotonic():
                del self._until[rk]
                return False
            return until is not None

    def clear(self) -> None:
        with self._lock:
            self._until.clear()
