"""The tiers as one narrow handle: what the loader (moving blocks up) and the cascade (moving
them down) are given, instead of the whole cache.

Knows: the tiers themselves -- the device pool, the host slab with the copies into it
(Transfer), and the tiers below the host as one list, fastest first (storage/lower_tier.py:
the disk, then the remote store) --, the one lock that guards them, and the per-tier counters.
`events` is the KV-event hook (storage/kv_events/sink.py; a no-op when events are off), handed
to every tier by `publish_to`: each tier says its own index's changes (the pool and the host slab
under the lock their callers hold: a put on a queue, never I/O); the cache says `cleared`.
Doesn't know: matching, planning or moving blocks (storage/tiered_cache.py places them,
storage/cascade.py moves them down, storage/loader.py moves them up).

NOTE (threads): `lock` guards the pool, the host slab's index and its slots' readers, the
Transfer's pending copies, the loader's maps of fills and prefetches, and `counters`. Whoever
holds it does no I/O and never waits on a writer, the network or a device copy while holding it:
a fill reading host slots pins them under it and copies with it free (storage/loader.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from storage.device_pool import DevicePool
from storage.host_tier import HostTier
from storage.kv_events.sink import NO_EVENTS, NoEvents
from storage.layout import BlockLayout
from storage.restore_rates import RestoreRates
from storage.lower_tier import LowerTier
from storage.tier_kinds import TIERS
from storage.transfer import Transfer



@dataclass
class TierStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0            # blocks served from this tier to a request
    hit_tokens: int = 0      # their prompt tokens (an exact entry's tail has fewer than a block, its logits none)
    promotions: int = 0      # blocks copied from this tier into device pages
    recomputed: int = 0      # blocks held here, billed as hits, recomputed by choice (compute-or-load)
    abandoned: int = 0       # blocks being read from here that a request stopped waiting for (its load
                             # deadline passed: engine/load_deadline.py) and computed instead
    abandoned_loads: int = 0  # loads with such a block
    reads_cancelled: int = 0  # reads from here cut off once no request waited for them (storage/loader.py:
                              # the remote's MGETs stop, so the link is free for the next request)
    demotions: int = 0       # blocks written into this tier from the tier above
    evictions: int = 0       # blocks that left this tier for lack of room
    bytes_read: int = 0
    bytes_written: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


@dataclass(eq=False)
class Tiers:
    layout: BlockLayout
    pool: DevicePool
    host: HostTier
    transfer: Transfer
    lower: tuple[LowerTier, ...]          # below the host, fastest first
    lock: threading.RLock = field(default_factory=threading.RLock)
    counters: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    # Each tier's measured restore rate (storage/restore_rates.py): fed by the loader's fills.
    rates: RestoreRates = field(default_factory=RestoreRates)
    # The KV-event hook (storage/kv_events/sink.py): NO_EVENTS unless the cache publishes events.
    events: NoEvents = NO_EVENTS

    def __post_init__(self) -> None:
        for below in self.lower:       # every wired tier is counted under its own name
            self.counters.setdefault(below.name, TierStats())

    def publish_to(self, sink: NoEvents) -> None:
        """Every tier says its changes to `sink` from now on (under the lock: storage/cache_events.py)."""
        self.events = self.pool.events = self.host.events = sink
        for below in self.lower:
            below.events = sink

    def below(self, name: str) -> LowerTier | None:
        """The lower tier called `name` (a fill's source, an operator's word), or None when it is
        not configured."""
        return next((t for t in self.lower if t.name == name), None)

    def above(self, tier: LowerTier) -> LowerTier | None:
        """The lower tier just above `tier` (the one that keeps what is read from it), or None."""
        i = self.lower.index(tier)
        return self.lower[i - 1] if i > 0 else None

    @property
    def next_down(self) -> LowerTier | None:
        """Where a block leaving the lowest in-memory tier goes: the first tier below the host."""
        return self.lower[0] if self.lower else None

    @property
    def linked(self) -> tuple[LowerTier, ...]:
        """The tiers below shared over a link (not `local`): asked with a probe, read on their own
        workers."""
        return tuple(t for t in self.lower if not t.local)

    def count_write(self, tier: str) -> None:
        """A block written into `tier` from the tier above (under the lock)."""
        st = self.counters[tier]
        st.demotions += 1
        st.bytes_written += self.layout.nbytes

    def count_promotion(self, tier: str) -> None:
        """A block copied into a device page, billed from `tier` (under the lock)."""
        st = self.counters[tier]
        st.promotions += 1
        st.bytes_read += self.layout.nbytes
