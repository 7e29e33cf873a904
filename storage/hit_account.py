"""One request's prompt-cache hits: facts about its prefix's blocks in, the bill by tier out.

Knows: the blocks this request's own prefetch moved into the host tier and the tier each was read
from (`moved_up`), the rule that gives a block its billed tier (`tier_of`), and -- from the
request's first admission on -- its hit tokens per tier (`by_tier`; None before). The facts, in
prefix order: blocks it holds at admission, each from the tier the cache served it from (a
device hit, or a fill's billed tier: Fill.billed_tier, decided by `tier_of` of the request that planned
the fill, so every request waiting for a fill and the promotion count agree); blocks held below
that it recomputes by choice (compute-or-load); blocks still loading (a split's back part, or a
late probe's back load after admission: `late_load`); and, at the join, those of them that did
not arrive (computed instead). Computed blocks are misses:
hit + miss == prompt tokens follows (`Usage.__post_init__` checks it).
Doesn't know: pages, fills, deadlines or the ledger (engine/billing.py); prices.

NOTE billing: decided once, at the first admission (`admitted`); a preempted request admitted
again is not billed again (our recompute, not the tenant's), and a forked choice carries its
request's bill (`forked`).

Threads: `moved` is written by the prefetch worker (storage/prefetch.py) and read by plan and
recomputed (storage/tiered_cache.py), all under the tiers' lock; `by_tier` is the engine thread's
alone (engine/scheduler.py), read by the output path once the request finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from storage.hashing import BlockKey
from storage.tiers import TIERS


@dataclass(eq=False)
class HitAccount:
    moved: dict[bytes, str] = field(default_factory=dict)   # hash -> the tier its own prefetch read
    by_tier: dict[str, int] | None = None                    # hit tokens billed per tier, once admitted

    # ---- facts from the prefetch (under the tiers' lock) ----------------------------------
    def moved_up(self, key: BlockKey, tier: str) -> None:
        """This request's own prefetch put `key` in a host slot, read from `tier`."""
        self.moved[key.hash] = tier

    # ---- the rule --------------------------------------------------------------------------
    def tier_of(self, key: BlockKey, found: str) -> str:
        """The tier a block found in `found` is billed from: where it was found, except a block in
        the host tier only because this request's own prefetch moved it there, billed from the
        tier the prefetch read (it was there when the request arrived)."""
        return self.moved.get(key.hash, found) if found == "host" else found

    # ---- facts at admission (engine thread) --------------------------------------------------
    @property
    def billed(self) -> bool:
        return self.by_tier is not None

    def admitted(self, held: Iterable[tuple[str, int]], recomputed: Iterable[tuple[str, int]] = (),
                 loading: Iterable[tuple[str, int]] = ()) -> None:
        """The first admission: (tier, tokens) of each block it holds, of each block held below it
        recomputes by choice, and of each block being loaded for it -- each a hit of its tier. A
        later admission (after a preemption) changes nothing."""
        if self.by_tier is not None:
            return
        by_tier = dict.fromkeys(TIERS, 0)
        for tier, tokens in (*held, *recomputed, *loading):
            by_tier[tier] += tokens
        self.by_tier = by_tier

    def late_load(self, blocks: Iterable[tuple[str, int]]) -> None:
        """(tier, tokens) of blocks being loaded for it after its admission (a late probe's answer,
        engine/probe_wait.py): hits of their tiers, unless computed instead."""
        for tier, tokens in blocks:
            self.by_tier[tier] += tokens

    def computed_instead(self, blocks: Iterable[tuple[str, int]]) -> None:
        """(tier, tokens) of blocks it was loading that did not arrive (a fill failed, or the load
        was abandoned at its deadline): it computes them, so they are not hits after all."""
        for tier, tokens in blocks:
            self.by_tier[tier] -= tokens

    def forked(self) -> "HitAccount":
        """A forked choice's account: the request's bill (already decided), nothing to add; the
        prefetch's facts stay the first sequence's (a choice re-admitted after a preemption bills
        nothing again, and its blocks count in the tier it finds them in)."""
        return HitAccount({}, dict(self.by_tier or {}))
