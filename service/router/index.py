"""The router's picture of every backend's cache: block hash -> {backend: the media holding it}.

Knows: how events change it (BlockStored adds a medium, BlockRemoved takes one away, and a block
is forgotten for a backend once no medium holds it; AllBlocksCleared and `clear` forget all of
a backend's blocks), and predictions: when a request is routed to a backend, its prompt's
blocks are assumed to be on that backend's device from then on, for `prediction_ttl_s`, so a
second request for a new prefix sent before the first one's events arrive follows it instead
of computing the prefix again elsewhere (and without events, predictions are all there is).
A BlockRemoved for a backend drops its predictions of those blocks too.
`prefix(hashes)` walks a request's block hashes in order and gives each backend its prefix:
the best medium of each block it holds, stopping at the first it does not (the engine's lookup
walks the same way).
Doesn't know: sockets, weights, load. NOTE: used from the event loop only (the subscribers and
the routes run there), so it takes no lock.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable

from storage import tier_kinds
from storage.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch

DEVICE_RANK = 0           # ranks: index into tier_kinds.media() ("GPU", the device pool, first); lower is faster


def rank_of(medium: str | None) -> int:
    """vLLM's medium None is the device pool; a medium this router does not know counts as the
    slowest. The media are the registered tier kinds' (storage/tier_kinds.py), read at each call."""
    if medium is None:
        return DEVICE_RANK
    ranks = tier_kinds.medium_ranks()
    return ranks.get(medium.upper(), len(ranks) - 1)


class PrefixIndex:
    def __init__(self, prediction_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.prediction_ttl_s = prediction_ttl_s
        self._clock = clock
        self._held: dict[bytes, dict[str, int]] = {}        # hash -> {backend: bit mask of media ranks}
        self._of_backend: dict[str, set[bytes]] = {}
        self._predicted: dict[bytes, dict[str, float]] = {}  # hash -> {backend: expiry}
        self._expiries: deque[tuple[float, str, tuple[bytes, ...]]] = deque()

    # ---- events --------------------------------------------------------------------------
    def apply_batch(self, backend: str, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.apply(backend, event)

    def apply(self, backend: str, event: Event) -> None:
        if isinstance(event, BlockStored):
            bit = 1 << rank_of(event.medium)
            mine = self._of_backend.setdefault(backend, set())
            for h in event.block_hashes:
                holders = self._held.setdefault(h, {})
                holders[backend] = holders.get(backend, 0) | bit
                mine.add(h)
        elif isinstance(event, BlockRemoved):
            bit = 1 << rank_of(event.medium)
            for h in event.block_hashes:
                holders = self._held.get(h)
                if holders is not None and backend in holders:
                    holders[backend] &= ~bit
                    if not holders[backend]:
                        self._forget(h, backend)
                predicted = self._predicted.get(h)
                if predicted is not None:
                    predicted.pop(backend, None)
        elif isinstance(event, AllBlocksCleared):
            self.clear(backend)

    def clear(self, backend: str) -> None:
        """Forget everything a backend holds or was predicted to hold (its restart, AllBlocksCleared)."""
        for h in self._of_backend.pop(backend, set()):
            holders = self._held.get(h)
            if holders is not None:
                holders.pop(backend, None)
                if not holders:
                    del self._held[h]
        for h in [h for h, p in self._predicted.items() if backend in p]:
            del self._predicted[h][backend]
            if not self._predicted[h]:
                del self._predicted[h]

    def _forget(self, h: bytes, backend: str) -> None:
        holders = self._held[h]
        del holders[backend]
        if not holders:
            del self._held[h]
        mine = self._of_backend.get(backend)
        if mine is not None:
            mine.discard(h)

    # ---- predictions ---------------------------------------------------------------------
    def predict(self, backend: str, hashes: Iterable[bytes]) -> None:
        hashes = tuple(hashes)
        if not hashes or self.prediction_ttl_s <= 0:
            return
        expiry = self._clock() + self.prediction_ttl_s
        for h in hashes:
            self._predicted.setdefault(h, {})[backend] = expiry
        self._expiries.append((expiry, backend, hashes))

    def _expire(self) -> None:
        now = self._clock()
        while self._expiries and self._expiries[0][0] <= now:
            _, backend, hashes = self._expiries.popleft()
            for h in hashes:
                p = self._predicted.get(h)
                if p is not None and p.get(backend, now + 1) <= now:     # not renewed since
                    del p[backend]
                    if not p:
                        del self._predicted[h]

    # ---- queries -------------------------------------------------------------------------
    def prefix(self, hashes: list[bytes], backends: Iterable[str]) -> dict[str, list[int]]:
        """Per backend, the best medium rank of each block of its cached prefix of `hashes`
        (a predicted block counts as on the device); [] for a backend holding none of it."""
        self._expire()
        out: dict[str, list[int]] = {b: [] for b in backends}
        walking = set(out)
        for h in hashes:
            if not walking:
                break
            held = self._held.get(h, {})
            predicted = self._predicted.get(h, {})
            for b in list(walking):
                mask = held.get(b, 0)
                if mask:
                    out[b].append((mask & -mask).bit_length() - 1)       # lowest set bit: the fastest medium
                elif b in predicted:
                    out[b].append(DEVICE_RANK)
                else:
                    walking.discard(b)
        return out

    def blocks(self, backend: str) -> int:
        return len(self._of_backend.get(backend, ()))

    def media(self, h: bytes) -> dict[str, list[str]]:
        """Which media of which backends hold a block (for tests and /health)."""
        known = tier_kinds.media()
        return {b: [known[r] for r in range(len(known)) if mask >> r & 1] for b, mask in self._held.get(h, {}).items()}

    def predicted(self, backend: str) -> int:
        self._expire()
        return sum(1 for p in self._predicted.values() if backend in p)
