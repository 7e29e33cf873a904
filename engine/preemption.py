"""Pages for a sequence that needs them, taken from others by preemption when the pool has none.

Knows: a running sequence's pages for its next tokens (the page it writes next copied first when
shared or cached: copy-on-write), the victims taken for them (from a tenant over its share first:
FairShare.growth_victim; itself last), and a starved tenant's admission (sequences of tenants over
their share preempted, and taken out of this step, until its pages can be had). Doesn't know: who
is fair game (engine/fair_share.py decides), what preempting does to a sequence (Scheduler.preempt
gives its pages back and puts it first in line), or admission and loads (engine/scheduler.py). It
counts in the scheduler's counters (`fair_preemptions`, `cow_copies`).

Thread: the engine thread's (`tieredkv-engine`), which alone steps the scheduler; no state of its
own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler import Scheduled, Scheduler
    from engine.sequence import Sequence


class Preemption:
    """Room in the pool for one scheduler's sequences."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def reserve(self, seq: Sequence, n: int, scheduled: list[Scheduled]) -> bool:
        """Pages for n more tokens of a running sequence, preempting others if needed (from a
        tenant over its share first: FairShare.growth_victim). False if `seq` itself had to be
        preempted."""
        s = self.s
        need = seq.pages_needed(seq.num_computed + n)
        # Copy-on-write: the page the next token goes into may be shared (a forked choice's
        # partial prompt page) or cached (an exact entry's tail): it is copied first.
        at = seq.num_computed // s.block_size
        cow = at < len(seq.pages) and s.cache.is_shared(seq.pages[at])
        while not s.cache.can_allocate(need + cow):
            candidates = [x for x in s.running if x is not seq and all(y.seq is not x for y in scheduled)]
            victim = s.fair.growth_victim(seq, candidates, s._shares())
            s.preempt(victim)
            if victim is seq:
                return False
        if cow:
            seq.pages[at] = s.cache.copy_on_write(seq.pages[at])
            s.cow_copies += 1
        seq.pages.extend(s.cache.allocate(need))
        return True

    def fair_room(self, seq: Sequence, need: int, out: list[Scheduled]) -> bool:
        """A starved tenant's admission: preempt sequences of tenants over their share (taken out
        of this step if scheduled) until `need` pages can be had. False: not enough to take."""
        s = self.s
        victims = s.fair.admission_victims(seq, need, s.cache.can_allocate, s.running, s._shares(seq))
        for victim in victims:
            s.fair.taken(victim)
            s.fair_preemptions += 1
            out[:] = [x for x in out if x.seq is not victim]
            s.preempt(victim)
        return bool(victims) and s.cache.can_allocate(need)
