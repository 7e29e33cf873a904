"""A request's wait for its probe of the tiers over a link, and what the answer is still worth when late.

Knows: the wait (at admission) and the late answer (while running). A request's probe (which of
its blocks each tier over a link, the shared store, holds: asked on a loader thread since submit,
storage/loader.py) is a round trip of the store. Its first turn at admission starts the wait: `LoadDeadlines.probe_seconds`
(engine/load_deadline.py: LOAD_MARGIN x the store's round-trip figure plus a small slack, never
more than a small fraction of the predicted recompute). Answered in time, the admission matches
the store's blocks as any tier's. Past the wait the request is admitted as if the store held
none of them -- it starts computing its prefix from the front, chunk by chunk, at once -- and its
probe stays out (`Sequence.late_probe`; SGLang HiCache's "timeout" prefetch policy: the request
never waits longer than the round trip is worth).
When the answer comes while the request still has uncomputed full blocks of its prefix that a
tier holds, those become a load from the back (Cake's split: compute from the front, load from
the back) with its own deadline, exactly as an admission's split back (the handle's load,
`PlannedLoad`, joined by the scheduler as a split's back is): the planner picks where the front
stops (`RestorePlanner.split` over the blocks not computed yet; "recompute" loads nothing), the
front computes up to that
block (finishing the block it is in), the back's pages are new ones planned by the cache, and
the two join once both are done. So a late but healthy probe still saves compute on a long prompt.
A late answer is used once the sequence has no other load in flight (an admission's split back
joins first), and never after a preemption (the re-admission reads the answer, if in, itself).

NOTE invariant (a wrong byte served is the worst failure): a late answer's load covers only
blocks at or after `len(seq.pages)`, pages the sequence never allocated: a block it computed or
is computing (its partial last page included) is never in it, and a back block that does not
arrive in time is computed into a fresh page (storage/load_outcome.py: late arrivals never land
in a computed page).

NOTE billing: blocks computed before the answer came, and blocks the planner chose to compute
after it, are billed as computed (misses); the back's blocks are billed to the tier each is
loaded from, and one whose fill fails or is given up is taken off again at the join, so
hit + miss == prompt tokens still.

Not the breaker's business: a probe admitted without its answer, or answered late, says nothing
about the store (a slow-but-answering store on a loaded machine is not a sick one). A probe call
that fails or times out at the store's own timeout is a failure as every call is
(storage/remote/tier.py `_call`).

Doesn't know: clocks (the scheduler's, injectable, handed in at each call), how many loads are in
flight (the scheduler says whether the loader has room), the store (the probe's answer is in
memory once `ChainProbe.done` is set), fills or pages beyond asking the cache to load them
(TieredKVCache.load_back, into the sequence's `blocks`).

Engine thread only: the scheduler calls it from admission and schedule(); its counters are read
by the engine's status (cost_model.load_deadline) on the engine thread or as plain ints.
"""
from __future__ import annotations

from typing import Callable

from engine.load_deadline import LoadDeadlines, planned_load
from engine.restore_planner import RestorePlanner
from engine.sequence import Sequence
from storage.kv_blocks import CacheMatch
from storage.load_records import ProbeAnswer
from storage.tiered_cache import TieredKVCache


class ProbeWait:
    def __init__(self, cache: TieredKVCache, block_size: int, planner: RestorePlanner | None,
                 deadlines: LoadDeadlines | None) -> None:
        self.cache = cache
        self.block_size = block_size
        self.planner = planner          # None: a late answer loads all it can
        self.deadlines = deadlines      # None: the probe is waited for, the load never given up
        self.abandoned = 0        # admissions without the probe's answer (past the wait)
        self.late_loads = 0       # late answers that planned a back load
        self.late_blocks = 0      # blocks those loads were planned for
        self.late_unused = 0      # late answers with nothing left worth loading

    def at_admission(self, seq: Sequence, clock: Callable[[], float]) -> tuple[bool, ProbeAnswer | None]:
        """(admit now, the linked tiers' answers for match()). Not admitted while the probe is out and
        within its wait; past it, admitted with none (the probe kept as `seq.late_probe`)."""
        probe = seq.probe
        if probe is None:
            return True, None
        if probe.done.is_set():
            return True, probe.answer
        if not self._overdue(seq, clock):
            return False, None
        if seq.late_probe is not probe:
            self.abandoned += 1
            seq.late_probe = probe
        return True, ProbeAnswer()

    def _overdue(self, seq: Sequence, clock: Callable[[], float]) -> bool:
        """True once the request has waited for its probe as long as the rule allows, from its
        first turn at admission (never, without deadlines)."""
        if self.deadlines is None:
            return False
        now = clock()
        if seq.probe_deadline is None:
            seq.probe_deadline = now + self.deadlines.probe_seconds(len(seq.prefix_keys()))
        return now >= seq.probe_deadline

    def late(self, seq: Sequence, clock: Callable[[], float], loader_free: Callable[[], bool]) -> None:
        """A running sequence admitted without its probe's answer: once the answer is in (and no
        other load of its is in flight), what a tier holds of its uncomputed prefix is loaded
        from the back. Called by schedule() before the sequence's next chunk is chosen;
        `loader_free()`: whether the loader takes one more load now."""
        probe = seq.late_probe
        if probe is None or not probe.done.is_set() or seq.load is not None:
            return
        if not loader_free():
            return        # back-pressure on the loader: asked again at its next step
        seq.late_probe = None
        bs = self.block_size
        keys = seq.prefix_keys()
        first = len(seq.blocks)        # the first block the sequence holds no page for
        if (not probe.answer or seq.hit_tokens_by_tier is None or first * bs < seq.num_computed
                or first >= len(keys)):
            self.late_unused += 1
            return
        match = self.cache.match(keys[first:], probed=probe.answer)
        start = first
        if len(match) and self.planner is not None:
            # The suffix after the matched blocks, as admission's split is told (engine/scheduler.py):
            # a back load joins before it runs, recomputing runs it in the front's chunks.
            suffix = len(seq.prompt_ids) - (first + len(match)) * bs
            start = self.planner.split(["device"] * first + [t for _, t in match.blocks], suffix_tokens=suffix).start
        back = self.cache.load_back(seq.blocks, CacheMatch(match.blocks[start - first:]), seq.hits) \
            if start < first + len(match) else ()
        if not back:
            self.late_unused += 1
            return
        seq.hits.late_load([(tier, bs) for tier in back])     # billed (storage/hit_account.py)
        seq.load_deadline = planned_load(self.deadlines, clock, start, start + len(back), back)
        seq.compute_until = start * bs
        self.late_loads += 1
        self.late_blocks += len(back)

    def snapshot(self) -> dict:
        return {"probes_abandoned": self.abandoned, "late_probe_loads": self.late_loads,
                "late_probe_blocks": self.late_blocks, "late_probes_unused": self.late_unused}
