"""Continuous batching over the paged pool: who runs this step, and with how many tokens.

Knows: the waiting queue, the loading set and the running set, the per-step token budget,
which matched blocks an admission takes, chunked prefill, preemption (newest first) and
in-batch dedup of shared prefix blocks. It meets the cache at one boundary (storage/kv_blocks.py):
one `plan` per admission (the match, its choice, the pages held and loads started), `join` for a
load that ended, `growth`/`grow` and `computed` as it runs, one `finish`; a sequence's pages are
an opaque `RequestBlocks` only the cache changes. Doesn't know: page ids, the model, sampling or
outputs -- the engine runs the forward pass on what `schedule()` returns and reports back via
`after_step()` -- nor how blocks are restored: the cache's loader fills pages on its own threads.

Per step: running sequences first (oldest first: each decode takes 1 token, an unfinished
prefill takes its next chunk), then sequences whose prefix finished loading (their first prefill
chunk), then admissions from the waiting queue while budget and pages last. An admission whose
prefix has blocks held below the device is planned (pages held, fills started) and waits in
`loading` without taking budget: the others keep stepping while its bytes are read (at most
`max_loading` such sequences at once). A request whose probe (which of its blocks the tiers over
a link, the shared store, hold: asked on a loader thread since submit) has not answered yet stays in the
queue about a round trip, the requests behind it admitted meanwhile; then it computes from the
front, and a late answer loads the rest from the back (engine/probe_wait.py). A sequence that
cannot get pages preempts the newest running one; the victim's full blocks are registered in
the cache already, so its re-admission hits them.

Fair share of the pool (engine/fair_share.py): a tenant below its share of the pages preempts for
its admission; a running sequence's page comes from a tenant over its share first. Admission's
order, the tenants' turns, and a newcomer's first chunk run alone: engine/admission_order.py.

Every load (a loading sequence's, or a running one's back part) has a deadline, derived from when
it was planned (engine/load_deadline.py) and today's figures, on this scheduler's clock (`clock`,
injectable for tests): a load not complete by then is abandoned in schedule() -- the sequence keeps the leading blocks
that arrived and computes the rest into fresh pages (storage/load_outcome.py), billed as
computed. Checked between steps: the engine thread never waits for a load.

An exact hit (storage/exact_entry.py: the prompt's tail block and stored logits cached too) is
admitted with nothing to compute (Scheduled with 0 tokens; the engine samples its stored logits).
NOTE invariant: the page a sequence writes next is its own -- copied first when it is shared (a
forked choice's partial prompt page) or cached (an exact entry's tail): engine/preemption.py.

NOTE invariant: an exception while admitting, reserving for or advancing one sequence is that
sequence's failure alone: it is set aside (take_failed) with whatever pages it holds, for the
engine to fail and release, and the step goes on for the others.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.admission_order import AdmissionOrder
from engine.fair_share import FairShare, Shares
from engine.load_deadline import LoadDeadlines, PlannedLoad, planned_load
from engine.preemption import Preemption
from engine.probe_wait import ProbeWait
from engine.restore_planner import RestorePlanner, Split
from engine.sequence import Scheduled, Sequence, SeqStatus
from storage.kv_blocks import CacheMatch, Take
from storage.tiered_cache import TieredKVCache

__all__ = ["Scheduled", "Scheduler"]     # Scheduled lives in engine/sequence.py (its helpers share it)


class Scheduler:
    def __init__(self, cache: TieredKVCache, max_batch_tokens: int = 512, max_seqs: int = 64,
                 max_loading: int = 8, decode_step_tokens: int | None = None,
                 planner: RestorePlanner | None = None, deadlines: LoadDeadlines | None = None,
                 clock: Callable[[], float] = time.monotonic, newcomer_first: bool = True,
                 weights: dict[str, float] | None = None) -> None:
        if max_batch_tokens < 1 or max_seqs < 1 or max_loading < 1:
            raise ValueError("max_batch_tokens, max_seqs and max_loading must be >= 1")
        if decode_step_tokens is not None and decode_step_tokens < 1:
            raise ValueError("decode_step_tokens must be >= 1 (or None: off)")
        # Stall-free batching (Sarathi-Serve's idea): while any sequence is decoding, a step takes
        # at most this many tokens, decodes first, so prefills (chunked to fit) never stretch the
        # time between a decoder's tokens past one step of this size. None: max_batch_tokens
        # always (more prefill per step: throughput over inter-token latency).
        self.decode_step_tokens = decode_step_tokens
        self.cache = cache
        self.block_size = cache.layout.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # admission order: oldest first
        self.loading: list[Sequence] = []       # prefix being filled by the loader, oldest first
        self.max_loading = max_loading
        # Compute or load (engine/restore_planner.py); None: every hit is loaded.
        self.planner = planner
        # When a load stops being waited for (engine/load_deadline.py); None: never.
        self.deadlines = deadlines
        self.clock = clock
        self.preemptions = 0
        # Fair share of the pool between tenants (engine/fair_share.py); `weights` by tenant.
        self.fair = FairShare(cache.pool.num_pages, self.block_size, weights)
        # Pages taken from others when the pool has none (engine/preemption.py).
        self.preemption = Preemption(cache, self.fair, self.block_size)
        # Who admission tries next, and the newcomer's step (engine/admission_order.py).
        self.order = AdmissionOrder(newcomer_first)
        # The wait for a probe of the linked tiers, a late answer's back load (engine/probe_wait.py).
        self.probes = ProbeWait(cache, self.block_size, planner, deadlines)
        self.exact_hits = 0           # admissions with nothing to compute (storage/exact_entry.py)
        self._failed: list[tuple[Sequence, Exception]] = []   # engine thread only

    @property
    def fair_preemptions(self) -> int:
        """Preemptions for a starved tenant's admission."""
        return self.preemption.fair_preemptions

    @property
    def cow_copies(self) -> int:
        """Pages copied before a write (shared or cached pages)."""
        return self.preemption.cow_copies

    def take_failed(self) -> list[tuple[Sequence, Exception]]:
        """Sequences whose own handling raised since the last call (the engine fails them)."""
        failed, self._failed = self._failed, []
        return failed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        budget = self.max_batch_tokens
        # At or below their share first: then a sequence over its share that needs a page finds
        # the others scheduled, and takes it from its own tenant (FairShare.growth_victim).
        shares = self._shares()
        running = sorted(self.running, key=lambda s: shares.over(s.tenant))
        holding = {s.tenant for s in (*self.running, *self.loading)}
        # Decodes are served every step (vLLM v1's chunked prefill beside decodes): a prefill chunk
        # takes what the budget holds beyond one token for each decode not yet scheduled, so a
        # long prompt ahead in this order (a tenant under its share) never starves a decoder.
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        owed = len(decoding)
        budget = max(budget, owed)
        if self.decode_step_tokens is not None and decoding:
            budget = max(owed, min(budget, self.decode_step_tokens))
            running = decoding + [s for s in running if s.num_tokens - s.num_computed != 1]
        out: list[Scheduled] = []
        for seq in running:
            if budget == 0:
                break
            decode = seq.num_tokens - seq.num_computed == 1
            owed -= decode
            if seq.status is not SeqStatus.RUNNING:
                continue   # preempted earlier in this loop
            try:
                self.probes.late(seq, self.clock, self._loader_free)   # a late probe's answer: the rest from the back
                if seq.load is not None and seq.num_computed == seq.compute_until:
                    late = not seq.load.ready()
                    if late and not self._past_deadline(seq):
                        continue       # its front is computed; its back is still loading
                    self._join(seq, abandon=late)
                n = min(seq.num_tokens - seq.num_computed, budget if decode else budget - owed)
                if seq.load is not None:
                    n = min(n, seq.compute_until - seq.num_computed)
                if n <= 0:
                    continue
                if not self.preemption.reserve(seq, n, out, self.running, self._shares, self.preempt):
                    continue
            except Exception as e:
                self._failed.append((seq, e))
                continue
            out.append(Scheduled(seq, n))
            budget -= n
        for seq in list(self.loading):
            if budget == 0:
                break
            late = not seq.load.ready()
            if late and not self._past_deadline(seq):
                continue
            self.loading.remove(seq)
            try:
                joined = self.cache.join(seq.blocks, abandon=late)
                seq.load_deadline = None                     # its pages are the sequence's own now
                started = self._start(seq, joined.arrived, joined.restore_s, budget)
            except Exception as e:
                self._failed.append((seq, e))
                continue
            if started is not None:
                out.append(started)
                budget -= started.num_tokens
        # In-batch dedup: a waiting request whose next uncached block is being computed by a
        # running prefill waits one step, then hits the registered block instead of computing it.
        pending = self._pending_prompt_blocks()
        # Once a request finds no pages: `short` (the shares, kept current) and its tenant `stalled`.
        step_budget, short, stalled = budget + sum(x.num_tokens for x in out), None, set()
        for seq in self.order.waiting(self.waiting, self.running, self.loading):
            budget = step_budget - sum(x.num_tokens for x in out)    # a fairness preemption gives back
            if budget <= 0 or len(self.running) + len(self.loading) >= self.max_seqs:
                break
            if short is not None and (seq.tenant in stalled or not short.under(seq.tenant)):
                continue     # only another tenant, below its share, may still take pages (FIFO within one)
            at = self.waiting.index(seq)
            del self.waiting[at]
            before = len(self.waiting)
            try:
                admitted = self._admit(seq, budget, pending, out)
            except Exception as e:
                self._failed.append((seq, e))
                continue
            if admitted is None or admitted is False:
                if seq.status is SeqStatus.WAITING and seq not in self.waiting:
                    at += len(self.waiting) - before          # victims went to the front
                    self.waiting.insert(at, seq)     # its place in line kept
                if admitted is False:
                    short = self._shares()
                    stalled.add(seq.tenant)
                continue
            short = short and self._shares()      # once short, kept current
            if admitted is True:
                continue    # now loading: no budget taken
            out.append(admitted)
            pending |= {k.hash for k in seq.prefix_keys()[seq.registered:]}
        return self.order.newcomers_first(out, holding)

    @property
    def newcomer_steps(self) -> int:
        """Steps that ran a newcomer's first chunk alone (engine/admission_order.py)."""
        return self.order.newcomer_steps

    def _shares(self, taken: Sequence | None = None) -> Shares:    # taken: out of the queue, being admitted
        return self.fair.shares((*self.running, *self.loading), (*self.waiting, *([taken] if taken else ())))

    def _pending_prompt_blocks(self) -> set[bytes]:
        pending = set()
        for seq in self.running:
            if seq.num_computed < len(seq.prompt_ids):
                pending.update(k.hash for k in seq.prefix_keys()[seq.registered:])
        return pending

    def _admit(self, seq: Sequence, budget: int, pending: set[bytes],
               out: list[Scheduled]) -> Scheduled | bool | None:
        """One call to the cache's plan (storage/kv_blocks.py), then either the first chunk or
        the wait for the loader. Scheduled: running now; True: loading; None: wait (a block
        another request computes now, or too many loads in flight); False: not enough pages now
        (stop admitting)."""
        ready, probed = self.probes.at_admission(seq, self.clock)    # engine/probe_wait.py
        if not ready:
            return None     # its probe is out and within its wait: others go first
        keys = seq.prefix_keys()
        # Exact hit (storage/exact_entry.py): the whole chain, tail and logits included, is cached.
        # Else the match is cut where a prefix hit is capped (len - 1 tokens), as it always was.
        exact = seq.exact if seq.exact is not None and not seq.output_ids else None
        plan = self.cache.plan(exact.chain if exact is not None else keys, probed, seq.hits,
                               lambda match: self._choose(seq, match, keys, exact, budget, pending, out),
                               prefix=len(keys) if exact is not None else None,
                               logits=len(exact.logits) if exact is not None else 0)
        if plan.blocks is None:
            return plan.verdict if not isinstance(plan.verdict, Take) else None
        seq.blocks = plan.blocks
        if plan.load_end:
            seq.load_deadline = self._deadline(plan.load_start, plan.load_end, plan.load_tiers)
        if plan.waiting:
            seq.status = SeqStatus.LOADING
            self.loading.append(seq)
            return True
        if plan.recomputed:
            seq.recomputed_hit_tokens = len(plan.recomputed) * self.block_size
        return self._start(seq, plan.held, plan.restore_s, budget, plan.recomputed, plan.back)

    def _choose(self, seq: Sequence, match: CacheMatch, keys: list, exact, budget: int, pending: set[bytes],
                out: list[Scheduled]) -> Take | bool | None:
        """Which of the matched blocks an admission takes (the cache holds them next): a Take, or
        None (wait) or False (no pages), as _admit answers."""
        blocks = match.blocks
        if exact is not None and len(blocks) < len(exact.chain):
            blocks, exact = blocks[:len(keys)], None
        if len(blocks) < len(keys) and keys[len(blocks)].hash in pending:
            return None
        needs_load = any(tier != "device" for _, tier in blocks)
        if needs_load and self.loads_in_flight() >= self.max_loading:
            return None     # back-pressure on the loader; requests without a load go ahead
        remaining = 0 if exact is not None else seq.num_tokens - len(blocks) * self.block_size
        n = min(remaining, budget)
        need = len(blocks) + -(-n // self.block_size)   # conservative: every matched block may need a page
        if not self.cache.can_allocate(need) and not self.preemption.fair_room(seq, need, out, self.running,
                                                                               self._shares(seq), self.preempt):
            # With nothing running every page is free or evictable, and the engine only accepts
            # sequences that fit the pool (Sequence.max_len), so this cannot stall forever.
            return False
        split = self._split(seq, blocks) if needs_load and exact is None else None
        if split is not None and split.start > split.device:
            # Compute-or-load: the device blocks [0, d) are acquired, blocks [d, s) are recomputed
            # by this sequence's prefill from now on, and blocks [s, n) are planned on the loader
            # at the same time. The sequence runs its front (never past block s) while its back
            # loads, and joins the back when both are done (_join).
            return Take(len(blocks), split.device, split.start, split.loaded)
        return Take(len(blocks))

    def _split(self, seq: Sequence, blocks) -> Split | None:
        """The planner's split for a first admission (None: load everything). A re-admission
        after preemption loads what the cache holds: its billing is decided, and its blocks are
        the pool's newest (often still on the device)."""
        if self.planner is None or seq.hit_tokens_by_tier is not None:
            return None
        return self.planner.split([tier for _, tier in blocks],
                                  suffix_tokens=len(seq.prompt_ids) - len(blocks) * self.block_size)

    def _start(self, seq: Sequence, tiers: tuple[str, ...], restore_s: float, budget: int,
               recomputed: tuple[str, ...] = (), back: tuple[str, ...] = ()) -> Scheduled | None:
        """A sequence holding its prefix's pages (`tiers`: each one's billed tier) starts running
        with its first chunk. None when the pages for that chunk are not there now (only after a
        load: the pool changed while it loaded): it gives its pages back and waits first in line;
        its restored blocks stay cached, so the next admission hits them on the device. With a
        split: `recomputed` are the billed tiers of the blocks after its pages it computes itself,
        and `back` those of the blocks loading after those."""
        if seq.blocks.logits:
            return self._start_exact(seq, tiers, restore_s)
        seq.num_computed = len(seq.blocks) * self.block_size
        if not seq.hits.billed:
            # NOTE billing (storage/hit_account.py): the first admission's facts -- the blocks the
            # cache held, served, recomputed by choice or being loaded (a back block whose fill
            # fails is taken off again at the join) -- each by the tier the cache gave it.
            bs = self.block_size
            seq.hits.admitted(held=[(t, bs) for t in tiers], recomputed=[(t, bs) for t in recomputed],
                              loading=[(t, bs) for t in back])
            seq.restore_s = restore_s
            seq.admitted_at = time.perf_counter()
        if seq.load is not None:
            seq.compute_until = (len(seq.blocks) + len(recomputed)) * self.block_size
        n = min(seq.num_tokens - seq.num_computed, budget)
        if seq.load is not None:
            n = min(n, seq.compute_until - seq.num_computed)
        if not self.cache.grow(seq.blocks, self.cache.growth(seq.blocks, seq.num_computed, seq.num_computed + n)):
            self._give_back(seq)
            self.waiting.appendleft(seq)
            return None
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return Scheduled(seq, n)

    def _start_exact(self, seq: Sequence, tiers: tuple[str, ...], restore_s: float) -> Scheduled:
        """An exact hit: the prompt's every block (its tail too) and its stored logits are held.
        It runs with nothing to compute: the engine samples its first token from the stored
        logits (`logits_pages`, held until then) and decodes on the cached pages (the tail page is
        copied before the sequence writes into it: Preemption.reserve). NOTE billing: every prompt token is
        a hit billed from the tier of the block holding it (the logits blocks hold none)."""
        seq.num_computed = len(seq.prompt_ids)
        if not seq.hits.billed:
            seq.hits.admitted(held=[(tier, len(key.token_ids)) for key, tier in zip(seq.exact.kv, tiers)])
            seq.restore_s = restore_s
            seq.admitted_at = time.perf_counter()
        seq.exact_hit = True
        self.exact_hits += 1
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return Scheduled(seq, 0)

    def adopt(self, seq: Sequence) -> None:
        """A running sequence made outside admission (a choice forked from its request's first
        sequence: engine/request_group.py), holding its pages already."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _join(self, seq: Sequence, abandon: bool = False) -> None:
        """A split sequence computed its front and its back finished loading (or, `abandon`, its
        deadline passed first): the back's pages join its page table after the front's. A back
        block whose fill failed (or had not arrived) ends the loaded part there; the sequence
        computes it and the rest (never less than it computed), and it is billed as computed
        (the cache did not hold it after all, or not in time)."""
        seq.load_deadline = None
        joined = self.cache.join(seq.blocks, seq.num_computed, abandon=abandon)
        seq.hits.computed_instead([(tier, self.block_size) for tier in joined.planned[len(joined.arrived):]])
        seq.num_computed += len(joined.arrived) * self.block_size
        seq.restore_s = joined.restore_s

    def _deadline(self, start: int, end: int, tiers) -> PlannedLoad | None:
        """A load of blocks [start, end) of a prompt (held in `tiers`), planned now: its deadline
        is derived from it at each check (LoadDeadlines.due: the figures as they are then)."""
        return planned_load(self.deadlines, self.clock, start, end, tiers)

    def _past_deadline(self, seq: Sequence) -> bool:
        return seq.load_deadline is not None and self.clock() >= self.deadlines.due(seq.load_deadline)

    def loads_in_flight(self) -> int:
        """Sequences waiting for the loader: loading ones, and running ones with a back part."""
        return len(self.loading) + sum(1 for s in self.running if s.load is not None)

    def _loader_free(self) -> bool:
        return self.loads_in_flight() < self.max_loading

    def _give_back(self, seq: Sequence) -> None:
        """Every page a sequence holds goes back (a back part still loading included)."""
        seq.load_deadline = None
        self.cache.finish(seq.blocks)
        seq.reset_for_preemption()

    def preempt(self, seq: Sequence) -> None:
        """Give back a running sequence's pages; it goes first in line to be re-admitted."""
        self.preemptions += 1
        self._give_back(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def after_step(self, scheduled: list[Scheduled]) -> None:
        """The forward pass wrote KV for the scheduled tokens: advance and register full blocks."""
        for s in scheduled:
            seq = s.seq
            seq.num_computed += s.num_tokens
            try:
                self.register_full_blocks(seq)
            except Exception as e:
                self._failed.append((seq, e))     # no token for it: the engine fails it

    def register_full_blocks(self, seq: Sequence) -> None:
        # Prompt and generated blocks alike: the next turn of a chat hits them.
        seq.extend_keys()
        self.cache.computed(seq.blocks, seq.keys, seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (or failed): wherever it is, its pages go back. A loading one
        gives back its planned pages; the fills in flight end on their own references."""
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.load_deadline = None
        self.cache.finish(seq.blocks)
