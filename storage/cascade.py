"""The cascade: how blocks move down the tiers, under pressure and on an operator's word.

Knows: each edge a block travels down -- device -> host (`device_to_host`, one batch of copies
per allocation's victims), host -> the next tier below (`host_to_lower`), a block into the next
tier below (`to_lower`), a lower tier's commits into the one below it (`forward`: disk -> remote,
the disk writer's payloads) --,
write-through (register copies at once; written down behind the engine by storage/host_writeback.py),
and the operator's moves: `flush` (every block to the lowest tier, waiting for the writers),
`demote` (one tier's blocks one step down) and `drop` (forget a tier's blocks).
Doesn't know: matching, planning, fills (storage/tiered_cache.py, storage/loader.py), how a
tier stores bytes, or which tiers there are: it walks `Tiers.lower` and asks each through
storage/lower_tier.py's verbs (a tier's own or shared over a link: `local`).

KV events (storage/kv_events/sink.py): every tier says its own, at its index's mutations (the
pool and the host slab after their `on_evict` -- these edges -- returned, so a router never sees
a block held nowhere that is still held); a batch of copies into host slots is committed
(HostTier.commit: one BlockStored CPU) once its copies are issued.

Threads: the pressure edges run on the engine thread under the tiers' lock (the pool and the
host slab call them while evicting): they issue device -> host copies (asynchronous on CUDA) and
queue host blocks on the write-behind, never waiting. The operator's moves run on the caller's
thread. NOTE invariant (the lock rule, issue 30): the lock is never held while waiting on a
writer, a device copy or a memcpy of a block. Under pressure a block is queued with wait=False
(a full queue drops it, counted); flush and demote reserve a batch of _FLUSH_BATCH blocks under
the lock, copy them out with no lock held, commit under it, and queue them with no lock held,
so the engine's next allocate or register never waits for a flush. What is left on the spot:
a host eviction of a block the write-behind has not reached yet (`inline_writes`, counted), and
device blocks sent down with no host slot to take them (no host tier, or every slot pinned).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

import torch

from storage.flush_result import FlushResult
from storage.hashing import BlockKey
from storage.host_writeback import HostWriteBack
from storage.lower_tier import LowerTier, private_copy
from storage.tier_kinds import kind_of
from storage.tiers import Tiers, TierStats
from storage.transfer import Transfer

_FLUSH_BATCH = 32     # blocks reserved, copied out, then committed per batch by flush/demote


class Cascade:
    def __init__(self, tiers: Tiers, *, write_through: bool, link_timeout_s: float) -> None:
        """`write_through`: blocks go down as they are registered (CacheConfig.write_policy, or a
        tier's own policy: storage/tier_wiring.py decides). `link_timeout_s`: the bound on a wait
        for room in the queue of a tier over a link (CacheConfig.remote_timeout_s)."""
        self.t = tiers
        self.write_through = write_through
        self.link_timeout_s = link_timeout_s
        # Host blocks written down behind the engine (write-through blocks, a full slab's LRU end).
        self.writeback = HostWriteBack(tiers)
        self.inline_writes = 0      # host evictions that had to copy their block down on the spot
        self._out_stream = None     # CUDA: the stream flush/demote copy device pages out on
        # The pool and the host slab hand their victims here, while the bytes are intact.
        tiers.pool.on_evict = self.device_evicted
        tiers.host.on_evict = self.host_evicted
        # Each tier's commits written into the one below it (the disk's payloads into the store).
        for upper, lower in zip(tiers.lower, tiers.lower[1:]):
            upper.on_commit(lambda committed, lower=lower: self.forward(lower, committed))

    @property
    def retained(self) -> Callable[[bytes], bool]:
        """Whether a block is retained (storage/cache_retention.py sets it where the disk keeps
        retained blocks): such a block is written through, whatever the policy, and its
        write-behind waits for room below rather than drop it."""
        return self.writeback.retained

    @retained.setter
    def retained(self, live: Callable[[bytes], bool]) -> None:
        self.writeback.retained = live

    # ---- under pressure (engine thread, lock held) --------------------------------------------
    def registered(self, key: BlockKey, page: int) -> None:
        """A block was just computed into `page`: under write-through (or retained) it goes down now."""
        if self.write_through or self.writeback.retained(key.hash):
            self.device_to_host([(key, page)], through=True)

    def device_evicted(self, blocks: list[tuple[BlockKey, int]]) -> None:
        """The pool evicts these (key, page): down to the host tier (the pool then says them gone)."""
        self.device_to_host(blocks)

    def host_evicted(self, key: BlockKey, slot: int) -> None:
        """The host tier evicts this slot's block: down to the next tier (the slab then says it gone).
        A block already below (written through) costs nothing here; any other is copied down on
        the spot, on the evicting thread (counted: `inline_writes`). NOTE (issue 30, open): a
        write-back eviction still memcpys its block under the lock; writing a full slab's LRU end
        down ahead (storage/host_writeback.py can) would make a small disk hold host blocks twice
        and evict its own older blocks for them, so it is not done."""
        if self.host_to_lower(key, slot):
            self.inline_writes += 1

    def device_to_host(self, blocks: list[tuple[BlockKey, int]], through: bool = False) -> None:
        """Device blocks (key, page) into host unless already there (and, `through`, on down).
        With no host tier they go straight to the next tier below."""
        t = self.t
        if not t.host.enabled:
            for key, page in blocks:
                self.to_lower(key, t.pool.kv[page])
            return
        copied = self._copy_to_host(blocks)
        if through:
            # NOTE: written down behind us (storage/host_writeback.py): its worker waits for the
            # copy, which waits for the forward that wrote the page (issue 9, item 6).
            self.writeback.submit(key for key, _ in copied)

    def _copy_to_host(self, blocks: list[tuple[BlockKey, int]]) -> list[tuple[BlockKey, int]]:
        """Copy device blocks (key, page) the host lacks into host slots, a batch of copies at a
        time. Returns the (key, slot) copied."""
        t = self.t
        copied = []
        start = 0
        while start < len(blocks):
            # A batch is at most the slots a reserve may take now (free, or an unpinned block's):
            # reserving a slot evicts the LRU unpinned block, and within a batch that must never
            # be a slot the same batch reserved (its copy is not issued yet, so the eviction's
            # wait would not see it and disk would get the slot's stale bytes). Pins change only
            # under the lock, which we hold.
            step = t.host.reservable()
            if step == 0:
                # Every slot is being read by a fill right now (a tiny slab): these blocks skip
                # the host tier, as with none configured.
                for key, page in blocks[start:]:
                    if t.host.slot_of(key) is None:
                        self.to_lower(key, t.pool.kv[page])
                break
            batch = []
            for key, page in blocks[start:start + step]:
                if t.host.slot_of(key) is not None:
                    continue
                slot = t.host.reserve(key)      # never None within `step` (see above)
                batch.append((slot, t.pool.kv[page]))
                copied.append((key, slot))
                t.count_write("host")
            t.transfer.copy_to_host(t.host.slab, batch)
            # Committed per batch (one BlockStored): the next batch's reserves may evict these.
            t.host.commit([slot for slot, _ in batch])
            start += step
        return copied

    def host_to_lower(self, key: BlockKey, slot: int) -> bool:
        """A host slot's block to the next tier below, on the caller's thread (the host tier's
        eviction of a block the write-behind has not taken down). True when it was queued."""
        below = self.t.next_down
        if below is None or below.contains(key):
            return False
        self.t.transfer.wait_host(slot)   # NOTE: the copy into the slot is complete before put reads it
        return self.to_lower(key, self.t.host.slab[slot])

    def to_lower(self, key: BlockKey, src: torch.Tensor) -> bool:
        """Queue a block (a device page, or a host slot already waited for) for the next tier
        below unless it holds it; never waits (the caller holds the lock): a full queue drops it
        (counted by the tier). put copies the bytes, so `src` may be reused once this returns."""
        below = self.t.next_down
        if below is None or below.contains(key):
            return False
        if not below.put(key, src.cpu(), wait=False):   # .cpu(): the tensor itself on CPU
            return False
        self.t.count_write(below.name)
        return True

    def forward(self, lower: LowerTier, committed: list) -> None:
        """The tier above `lower` committed these (key, payload, raw size): queue them for `lower`
        (the disk's commits for the store's write-behind). Runs on the upper tier's writer thread:
        waits for room in `lower`'s queue at most one link timeout in all, then drops (counted), so
        a slow store slows disk commits by a bounded amount and never stops them."""
        deadline = time.monotonic() + self.link_timeout_s
        for key, payload, raw_size in committed:
            lower.put(key, payload=payload, raw_size=raw_size, wait=True,
                      timeout=max(0.0, deadline - time.monotonic()))

    # ---- the operator's moves (caller's thread) ---------------------------------------------
    def _copies_out(self, host_only: bool = False, skip: Callable[[BlockKey], bool] = lambda key: False,
                    seen: list[BlockKey] | None = None) -> Iterator[list[tuple[BlockKey, torch.Tensor]]]:
        """Every cached block (device pages unless host_only, then host slots) copied to private
        CPU tensors a batch at a time, each batch yielded with no lock held (the caller may wait
        on a writer). A block that moved or left meanwhile is taken from where it is now, or
        skipped (its own eviction queued it), as is one `skip(key)` (asked under the lock) names.
        `seen` receives every block taken into account.

        NOTE (the lock rule): each batch is reserve / copy / commit. Under the lock the batch's
        host slots are pinned (never evicted or reused while pinned) with their pending copies
        in, and its device pages noted with their generation; with no lock held the copies in
        are waited for and every block is copied out (device pages on a stream of their own on
        CUDA, ordered after the forwards so far); under the lock again the slots are unpinned
        and a device copy is kept only if its page still holds the block it held (else the
        block was evicted meanwhile -- to a host slot: taken from there in a later batch). Pages
        are not held by a reference: the engine's check-then-allocate must never find a page
        gone, so a flush never takes one from it."""
        t = self.t
        with t.lock:
            todo = [] if host_only else [t.pool.key_of(p) for p in t.pool.cached_pages()]
            todo += [key for _, key in t.host.blocks()]
        if seen is not None:
            seen.extend(todo)
        queue, moved = deque(todo), set()
        while queue:
            batch = [queue.popleft() for _ in range(min(_FLUSH_BATCH, len(queue)))]
            pages, slots, copies, device = [], [], [], []
            with t.lock:                                  # reserve
                for key in batch:
                    if skip(key):
                        continue
                    page = None if host_only else t.pool.page_of(key)
                    if page is not None:
                        pages.append((key, page, t.pool.generation(page)))
                        continue
                    slot = t.host.slot_of(key)
                    if slot is not None:
                        t.host.pin(slot)
                        slots.append((key, slot, t.transfer.pending(slot)))
            try:                                          # copy, no lock held
                for _, _, copy_in in slots:
                    Transfer.wait(copy_in)
                copies = [(key, private_copy(t.host.slab[slot])) for key, slot, _ in slots]
                device = self._copy_pages_out([page for _, page, _ in pages])
            finally:
                with t.lock:                              # commit
                    for _, slot, _ in slots:
                        t.host.unpin(slot)
                    for (key, page, gen), block in zip(pages, device):
                        if t.pool.page_of(key) == page and t.pool.generation(page) == gen:
                            copies.append((key, block))
                        elif key.hash not in moved:       # evicted meanwhile: from where it is now
                            moved.add(key.hash)
                            queue.append(key)
            yield copies

    def _copy_pages_out(self, pages: list[int]) -> list[torch.Tensor]:
        """Private CPU copies of device pages, made with no lock held; the caller checks afterwards
        that each page still holds its block. On CUDA: one batch on a stream of our own, ordered
        after the compute stream's work so far (the default stream, which the engine computes on:
        the pages' forwards), into pinned memory, waited for by this thread alone -- the engine's
        next kernels do not queue behind it."""
        if not pages:
            return []
        kv = self.t.pool.kv
        if kv.device.type != "cuda":
            return [private_copy(kv[page]) for page in pages]
        if self._out_stream is None:
            self._out_stream = torch.cuda.Stream(device=kv.device)
        stream = self._out_stream
        out = torch.empty((len(pages), *kv.shape[1:]), dtype=kv.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(stream):
            for i, page in enumerate(pages):
                out[i].copy_(kv[page], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return list(out.unbind(0))

    def copy_down(self, host_only: bool = False, seen: list[BlockKey] | None = None) -> int:
        """Every cached block the next tier below lacks (device pages unless host_only, then host
        slots) queued for it, waiting for room with no lock held. Returns blocks queued; `seen`
        receives every cached block it took into account (queued, or held below already)."""
        below = self.t.next_down
        # A store may be down: each block waits a bounded time (then drops, counted); the disk's
        # writer always drains, so a disk put waits as long as it takes.
        timeout = None if below.local else self.link_timeout_s * 4
        written = 0
        for copies in self._copies_out(host_only, skip=below.contains, seen=seen):
            # The copies are this thread's own (private_copy, or a fresh batch from the device):
            # handed over, not copied a second time (a flush's thread spent a third of its time there).
            queued = [key for key, block in copies if below.put(key, block, wait=True, timeout=timeout, owned=True)]
            with self.t.lock:
                for _ in queued:
                    self.t.count_write(below.name)
            written += len(queued)
        return written

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Push every cached block down to the first tier below the host (the disk, else the
        store, else the host) and wait for the writers: after a complete flush a restarted
        process hits every block. Every tier below is waited for too: blocks the disk commits are
        forwarded to the store. `remote` says whether every write to a tier over a link was sent
        (a store that is down makes it False, never the flush fail); `complete` and `held`
        answer for the first tier below when it is this process's own (`local`)."""
        t = self.t
        # A tier's commits forward blocks to the one below, whose writer may fail a batch before
        # this flush waits for it: each tier's mark makes such a loss count too.
        marks = {id(below): below.write_failures() for below in t.lower}
        behind = self.writeback.written
        self.writeback.wait_idle()     # write-through blocks reach the writers' queues (no lock held)
        behind = self.writeback.written - behind      # ...counted as this flush's writes
        complete, evicted, held, seen = True, 0, None, []
        first = t.next_down
        if first is not None:
            evictions = _evictions(first) if first.local else None
            written = behind + self.copy_down(seen=seen)
            if first.local:
                complete = first.drain(timeout, since=marks[id(first)])
                # NOTE: complete means on disk now -- the writer done is not enough: a disk smaller
                # than the cache evicts this flush's own blocks to make room for the next ones.
                evicted = _evictions(first) - evictions
                seen = list({key.hash: key for key in seen}.values())   # a block on device and host: once
                held = sum(map(first.contains, seen))
                complete = complete and held == len(seen)
        elif not t.host.enabled:
            return FlushResult(0, True)
        else:
            with t.lock:   # nothing below the host: device blocks into the host slab (copies issued)
                copied = self._copy_to_host([(t.pool.key_of(page), page) for page in t.pool.cached_pages()])
                copies = [t.transfer.pending(slot) for _, slot in copied]
            for done in copies:     # complete before the flush answers: waited for with no lock held
                Transfer.wait(done)
            written = len(copied)
        sent = [below.drain(timeout, since=marks[id(below)]) for below in t.linked]
        return FlushResult(written, complete, all(sent) if sent else None, evicted, held, len(seen))

    def demote(self, tier: str) -> int:
        """Evict every unused cached block of `tier` one step down the cascade (device -> host
        -> disk), exactly as capacity pressure would. Returns blocks evicted."""
        t = self.t
        if tier not in ("device", "host"):
            raise ValueError(f"tier: can demote 'device' or 'host', got {tier!r}")
        below = t.next_down
        if tier == "host" and below is not None and below.local:
            self.copy_down(host_only=True)   # the writes, outside the lock; then evict (a store
                                             # over a link takes the evictions' puts, never waited for)
        if tier == "device":
            # In batches: each eviction may cascade host -> disk (a put that never waits), so
            # between batches, holding no lock, wait for the writer's queue to have room: an
            # explicit demote never drops a block for a full queue, and never stalls the engine.
            evicted = 0
            while True:
                with t.lock:
                    pages = t.pool.evictable_pages()[:_FLUSH_BATCH]
                    t.pool.evict(pages)
                evicted += len(pages)
                if len(pages) < _FLUSH_BATCH:
                    return evicted
                if below is not None:
                    below.wait_for_room()     # a tier over a link answers at once (it drops)
        with t.lock:
            n = 0
            while len(t.host) and t.host.evict_lru():   # a block a fill is reading now stays
                n += 1
            return n

    def drop(self, tier: str) -> int:
        """Forget every cached block of one tier (device: only pages no sequence uses)."""
        t = self.t
        if not kind_of(tier).local:     # ValueError for a name no kind has
            # Every server's blocks live there: clearing it is the store operator's call
            # (FLUSHDB, or its LRU and TTL), not one server's -- configured here or not.
            raise ValueError(f"tier: the {tier} tier is shared by every server and is not dropped from one")
        with t.lock:
            if tier == "device":
                pages = t.pool.evictable_pages()
                t.pool.drop(pages)
                return len(pages)
            if tier == "host":
                return t.host.remove_many(t.host.hashes())
        below = t.below(tier)
        if below is None:
            return 0
        below.drain()
        return below.clear()


def _evictions(below: LowerTier) -> int:
    """The blocks `below` has evicted so far, read from its stats record as the cache reports it."""
    st = TierStats()
    below.stats().report(st)
    return st.evictions
