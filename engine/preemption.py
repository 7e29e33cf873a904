"""Pages for a sequence that needs them, taken from others by preemption when the pool has none.

Knows: a running sequence's pages for its next tokens (the page it writes next copied first when
shared or cached: copy-on-write), the victims taken for them (from a tenant over its share first:
FairShare.growth_victim; itself last), and a starved tenant's admission (sequences of tenants over
their share preempted, and taken out of this step, until its pages can be had). Doesn't know: who
is fair game (engine/fair_share.py decides), what preempting does to a sequence (the `preempt` it
is handed: the scheduler's, which gives its pages back and puts it first in line), or admission
and loads (engine/scheduler.py). It is handed the running sequences and the shares of the pool at
each call, and counts what it did (`fair_preemptions`, `cow_copies`).

Thread: the engine thread's (`tieredkv-engine`), which alone steps the scheduler; its counters
are plain ints.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engine.fair_share import FairShare, Shares
from engine.sequence import Scheduled, Sequence

if TYPE_CHECKING:
    from storage.tiered_cache import TieredKVCache


class Preemption:
    """Room in the pool for one scheduler's sequences."""

    def __init__(self, cache: TieredKVCache, fair: FairShare, block_size: int) -> None:
        self.cache = cache
        self.fair = fair
        self.block_size = block_size
        self.cow_copies = 0           # pages copied before a write (shared or cached pages)
        self.fair_preemptions = 0     # preemptions for a starved tenant's admission

    def reserve(self, seq: Sequence, n: int, scheduled: list[Scheduled], running: list[Sequence],
                shares: Callable[[], Shares], preempt: Callable[[Sequence], None]) -> bool:
        """Pages for n more tokens of a running sequence, preempting others of `running` if needed
        (from a tenant over its share first: FairShare.growth_victim, by `shares()` as they stand
        at each pick). False if `seq` itself had to be preempted."""
        cache = self.cache
        # Copy-on-write: the page the next token goes into may be shared (a forked choice's
        # partial prompt page) or cached (an exact entry's tail): it is copied first (the cache's
        # growth says so, TieredKVCache.growth).
        need = cache.growth(seq.blocks, seq.num_computed, seq.num_computed + n)
        while not cache.can_allocate(need.total):
            candidates = [x for x in running if x is not seq and all(y.seq is not x for y in scheduled)]
            victim = self.fair.growth_victim(seq, candidates, shares())
            preempt(victim)
            if victim is seq:
                return False
        if not cache.grow(seq.blocks, need):
            raise RuntimeError(f"{need.total} pages were there for {seq.request_id} and are not now")
        self.cow_copies += need.copy_at is not None
        return True

    def fair_room(self, seq: Sequence, need: int, out: list[Scheduled], running: list[Sequence],
                  shares: Shares, preempt: Callable[[Sequence], None]) -> bool:
        """A starved tenant's admission: preempt sequences of tenants over their share (taken out
        of this step if scheduled) until `need` pages can be had. False: not enough to take."""
        victims = self.fair.admission_victims(seq, need, self.cache.can_allocate, running, shares)
        for victim in victims:
            self.fair.taken(victim)
            self.fair_preemptions += 1
            out[:] = [x for x in out if x.seq is not victim]
            preempt(victim)
        return bool(victims) and self.cache.can_allocate(need)
