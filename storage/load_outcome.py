"""How a request's load ends: every block arrived, or the request stopped waiting for it.

Knows: which of a Load's pages a request keeps -- the leading blocks that arrived, up to the first
block whose fill failed or has not ended -- and what happens to the rest: the request's reference
on each is given back, and a fill still running keeps its own (storage/loader.py) and ends on it.
Counts, per tier a block was being read from, the blocks and loads a request gave up on
(`TierStats.abandoned`, `abandoned_loads`), and tells each tier read from that a read was too
slow to wait for (LowerTier.read_late: the remote's breaker counts a failure). Doesn't know: deadlines or clocks (the scheduler decides when to stop
waiting: engine/load_deadline.py), sequences or billing.

NOTE invariant (a late block never lands in a computed page): the pages of blocks that had not
arrived are never the request's again -- it computes those blocks into fresh pages. Such a page
is held by its fill until the fill ends; a block that arrives late is registered in the cache for
the next request, or, when the request already registered the block it computed, dropped (its
page freed). Either way no page a request computes into is ever written by a fill.

Runs on the engine thread under the tiers' lock (TieredKVCache.finish_load): no I/O, no wait.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from storage.load_records import Load
from storage.tiers import Tiers


@dataclass(frozen=True, slots=True)
class Acquired:
    """Device pages now held (refcount +1) for a matched prefix, with each block's source tier.
    May be shorter than the match: a disk block that fails verification ends the prefix."""
    pages: tuple[int, ...]
    tiers: tuple[str, ...]
    restore_s: float


def arrived(load: Load) -> int:
    """The leading blocks of `load` a request can use now: up to the first block whose fill has
    not ended, or ended without its bytes (a device hit has no fill and is always there)."""
    # `done` first: a fill's `ok` is written before its `done` is set, and is read only after.
    return next((i for i, f in enumerate(load.fills) if f is not None and not (f.done.is_set() and f.ok)),
                len(load.fills))


def finish(tiers: Tiers, load: Load, abandon: bool = False) -> Acquired:
    """The prefix a request keeps of `load` (under the tiers' lock): its arrived blocks, counted as
    hits of their billed tiers; the pages after them given back. Without `abandon` the load is
    ready (every fill ended). With it, the request stops waiting (its deadline passed): each fill
    that had not ended is counted abandoned in the tier it reads, and a remote one is a failure
    for the store's breaker (once per load: the store did not answer in time)."""
    cut = arrived(load)
    for page in load.pages[cut:]:
        tiers.pool.release(page)
    for tier, n in zip(load.tiers[:cut], load.tokens[:cut]):
        tiers.counters[tier].hits += 1
        tiers.counters[tier].hit_tokens += n
    if abandon:
        late = [f.read_from for f in load.fills[cut:] if f is not None and not f.done.is_set()]
        for source in late:
            tiers.counters[source].abandoned += 1
        for source in set(late):
            tiers.counters[source].abandoned_loads += 1
        for below in tiers.lower:
            if below.name in late:
                below.read_late()      # the remote's breaker: a small lock of its own, no I/O
    return Acquired(tuple(load.pages[:cut]), tuple(load.tiers[:cut]), time.perf_counter() - load.started)
