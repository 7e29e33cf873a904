"""Fair share of the device pool between tenants: whose sequence is preempted so another gets pages.

Knows: the pages each tenant holds (the page tables of its running and loading sequences: a page
two of its own sequences share counts for both), each active tenant's fair share of the pool
(pool pages / tenants with a sequence running, loading or waiting; weights optional), and which
sequence a preemption takes -- for a starved tenant's admission (`admission_victims`) and for a
running sequence that needs a page (`growth_victim`). Doesn't know: the pool's free list, how a
preemption is carried out (Scheduler.preempt: pages back, its full blocks stay cached and go down
to the host tier as the pool evicts them, so the resume is a hit), nor billing.

Rules, as built:
- A tenant is starved when it holds less than its share and its request cannot get pages. Only
  then does admission preempt for fairness, and only sequences of another tenant holding more
  than its share, newest first, and never one whose loss would take its tenant below its share.
- Progress (no livelock): a sequence preempted for fairness is not taken again for fairness
  until it has computed a block past where it was taken (`Sequence.fair_guard`); its re-admission
  goes first in line (engine/admission_order.py), so each preempt/resume cycle moves it on.
- A running sequence that needs a page takes it from a tenant over its share first (the newest of
  its sequences that leaves it at or above its share); a sequence of a tenant over its share that
  finds no such victim gives way itself rather than take from a tenant at or below its share;
  otherwise the classic rule: the newest other sequence, else itself.

Engine thread only (the scheduler's): nothing here is shared.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Shares:
    """One moment's page holdings and fair shares, by tenant."""
    held: Mapping[str, int]        # pages in the page tables of its running and loading sequences
    share: Mapping[str, float]     # its fair share of the pool, in pages (active tenants only)

    def of(self, tenant: str) -> float:
        return self.share.get(tenant, 0.0)

    def over(self, tenant: str) -> bool:
        return self.held.get(tenant, 0) > self.of(tenant)

    def under(self, tenant: str) -> bool:
        return self.held.get(tenant, 0) < self.of(tenant)

    def keeps_share_without(self, seq: Sequence) -> bool:
        """Whether seq's tenant still holds at least its share once seq's pages are gone."""
        return self.held.get(seq.tenant, 0) - len(seq.blocks) >= self.of(seq.tenant)


class FairShare:
    def __init__(self, num_pages: int, block_size: int, weights: Mapping[str, float] | None = None) -> None:
        if num_pages < 1 or block_size < 1:
            raise ValueError("num_pages and block_size must be >= 1")
        self.check_weights(weights)
        self.num_pages = num_pages
        self.block_size = block_size
        self.weights = dict(weights or {})     # a tenant not named weighs 1

    @staticmethod
    def check_weights(weights: Mapping[str, float] | None) -> None:
        if weights is not None and not all(isinstance(t, str) and isinstance(w, (int, float)) and not isinstance(w, bool)
                                           and 0 < w < float("inf") for t, w in weights.items()):
            raise ValueError(f"tenant_weights: expected {{tenant: weight > 0}}, got {dict(weights)!r}")

    def shares(self, holders: Iterable[Sequence], waiting: Iterable[Sequence]) -> Shares:
        """Holdings of `holders` (running and loading sequences) and the shares of every tenant
        with a sequence among them or in `waiting`."""
        held: Counter[str] = Counter()
        active = set()
        for s in holders:
            held[s.tenant] += len(s.blocks)
            active.add(s.tenant)
        active.update(s.tenant for s in waiting)
        total = sum(self.weights.get(t, 1.0) for t in active)
        share = {t: self.num_pages * self.weights.get(t, 1.0) / total for t in active}
        return Shares(held, share)

    def admission_victims(self, seq: Sequence, need: int, fits: Callable[[int], bool], running: list[Sequence],
                          shares: Shares) -> list[Sequence]:
        """The sequences to preempt, newest first, so that `seq` (waiting; it needs `need` pages;
        `fits(n)`: whether n pages can be had now) is admitted: empty unless seq's tenant is below
        its share and enough pages can be taken from tenants over theirs without taking any below
        it. (A page a victim shares with another sequence is counted as freed: the caller checks
        again after preempting.)"""
        if not shares.under(seq.tenant):
            return []
        held = dict(shares.held)
        victims, freed = [], 0
        for s in reversed(running):          # newest first
            if fits(need - freed):
                break
            if (s.tenant != seq.tenant and s.num_computed >= s.fair_guard and len(s.blocks)
                    and held.get(s.tenant, 0) - len(s.blocks) >= shares.of(s.tenant)):
                victims.append(s)
                freed += len(s.blocks)
                held[s.tenant] -= len(s.blocks)
        return victims if fits(need - freed) else []

    def growth_victim(self, seq: Sequence, candidates: list[Sequence], shares: Shares) -> Sequence:
        """Whom a running `seq` that needs a page preempts; `candidates`: the running sequences it
        may take (not itself, none already scheduled this step), oldest first. May be seq itself."""
        for s in reversed(candidates):
            if shares.over(s.tenant) and shares.keeps_share_without(s):
                return s
        if shares.over(seq.tenant):
            return seq            # it yields before a tenant at or below its share does
        return candidates[-1] if candidates else seq

    def taken(self, seq: Sequence) -> None:
        """seq is being preempted for fairness: it is not taken again for fairness until it has
        computed a block past where it is now."""
        seq.fair_guard = seq.num_computed + self.block_size
