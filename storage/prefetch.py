"""The disk -> host prefetch: a new request's blocks held by a local tier below read into host
slots in the background, so its time in the queue overlaps the drive.

Knows: the blocks queued or being read (hash -> `_Chunk`, a chunk of PREFETCH_CHUNK blocks per
task), its worker, and how many blocks it brought up. Doesn't know: requests, fills or billing --
TieredKVCache.prefetch picks the blocks (at most half the host tier) and hands a `Prefetch` record
(the chunks) and the request's hit account, told each block moved and the tier it was read from
(HitAccount.moved_up); the loader's fills ask `wait_or_claim` before reading. It names no tier below the host (it is
handed one).

Threads (NOTE: who owns what): `chunks` is written under the tiers' lock. A chunk runs on the
`tieredkv-prefetch` worker: read and decoded with no lock held; then its host slots are reserved
and pinned under the lock (each announced to readers as a pending copy, Transfer.writing), written
with no lock held, committed under it (HostTier.commit: readable, one BlockStored CPU; a slot whose
copy failed is removed unsaid). A fill waits for a chunk being read and claims the blocks of chunks
not started; a prefetch never waits on a fill (separate pools, so a full pool of waiting fills
cannot starve the prefetches they wait for).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from storage.hashing import BlockKey
from storage.hit_account import HitAccount
from storage.load_records import Prefetch, _Chunk
from storage.lower_tier import LowerTier
from storage.priority import background_priority
from storage.tiers import Tiers
from storage.transfer import Transfer

log = logging.getLogger("tieredkv.loader")

PREFETCH_WORKERS = 1    # a prefetch is I/O-bound readahead; one at a time keeps the drive streaming
PREFETCH_CHUNK = 8      # blocks per prefetch task: a fill claims the chunks not started yet


class Prefetcher:
    def __init__(self, tiers: Tiers) -> None:
        self.t = tiers
        self.chunks: dict[bytes, _Chunk] = {}      # under the tiers' lock
        self._pool = ThreadPoolExecutor(PREFETCH_WORKERS, thread_name_prefix="tieredkv-prefetch",
                                        initializer=background_priority)
        self.prefetched_blocks = 0

    def start(self, tier: LowerTier, keys: Sequence[BlockKey], into: Prefetch, hits: HitAccount) -> None:
        """Read these blocks of a local tier below (the disk) into the host tier in the background,
        PREFETCH_CHUNK at a time (called under the tiers' lock, with the blocks in `tier`, not in
        flight, not prefetched); `hits` is told each block moved."""
        for i in range(0, len(keys), PREFETCH_CHUNK):
            chunk = _Chunk(list(keys[i:i + PREFETCH_CHUNK]))
            for k in chunk.keys:
                self.chunks[k.hash] = chunk
            into.chunks.append(chunk)
            self._pool.submit(self._run, tier, chunk, hits)

    def wait_or_claim(self, keys: Sequence[BlockKey]) -> None:
        """Before a fill reads `keys` (on its worker, no lock held): a block a prefetch is decoding
        now lands in the host tier, so the fill waits for it rather than decoding it twice; a block
        only queued for prefetch is claimed (the prefetch skips it) and read by the fill, straight
        into its page: a request admitted at once never waits for a prefetch that has not started.
        (A prefetch's own failure is a miss, seen by the fill.)"""
        with self.t.lock:
            started = set()
            for key in keys:
                chunk = self.chunks.get(key.hash)
                if chunk is None:
                    continue
                if chunk.started:
                    started.add(chunk)
                else:
                    del self.chunks[key.hash]
        for chunk in started:
            chunk.done.wait()

    def _run(self, tier: LowerTier, chunk: _Chunk, hits: HitAccount) -> None:
        c = self.t
        keys: list[BlockKey] = []
        try:
            with c.lock:
                # Only what is still this chunk's: a fill may have claimed a block meanwhile.
                keys = [k for k in chunk.keys if self.chunks.get(k.hash) is chunk]
                chunk.started = True
            if not keys:
                return
            if not c.host.enabled:
                tier.read_ahead(keys)      # no host tier to hold them: warm the OS page cache
                return
            started = time.perf_counter()
            blocks = tier.get_many(keys)
            # The tier's read rate, as its fills record it: when a prefetch brings a hit's blocks
            # up first, the fill comes from the host, and the disk would otherwise go unmeasured.
            c.rates.observe(tier.name, sum(b is not None for b in blocks) * c.layout.nbytes,
                            time.perf_counter() - started)
            # Reserve under the lock (each slot pinned, its copy announced: a fill planned from it
            # meanwhile waits for our Future), copy with no lock held, commit under the lock.
            taken: list[tuple[BlockKey, int, torch.Tensor, object, Future]] = []
            with c.lock:
                for key, block in zip(keys, blocks):
                    if block is None or c.pool.page_of(key) is not None or c.host.slot_of(key) is not None:
                        continue
                    slot = c.host.reserve(key)
                    if slot is None:               # every slot is being read by a fill now
                        continue
                    c.host.pin(slot)
                    before, mine = c.transfer.writing(slot)
                    taken.append((key, slot, block, before, mine))
                    hits.moved_up(key, tier.name)     # a fact for the request's bill
            try:
                for key, slot, block, before, mine in taken:
                    Transfer.wait(before)          # a dropped block's late copy must not land on ours
                    c.host.slab[slot].copy_(block.view(c.layout.shape))
                    mine.set_result(None)
            finally:
                with c.lock:
                    copied = []
                    for key, slot, _, _, mine in taken:
                        if not mine.done():        # the copy failed: the slot holds no block (unsaid)
                            if c.host.slot_of(key) == slot:
                                c.host.remove(key.hash)
                            mine.set_result(None)
                        else:
                            copied.append(slot)
                    # Readable now: one BlockStored CPU (a block removed meanwhile says nothing).
                    self.prefetched_blocks += len(c.host.commit(copied))
                    for _, slot, _, _, _ in taken:
                        c.host.unpin(slot)
        except Exception:
            log.exception("prefetching %d %s blocks failed: their requests read them later", len(keys), tier.name)
        finally:
            with c.lock:
                for k in keys:
                    if self.chunks.get(k.hash) is chunk:
                        del self.chunks[k.hash]
            chunk.done.set()

    def close(self) -> None:
        """Stop the worker (a chunk running ends first: it reads the disk)."""
        self._pool.shutdown(wait=True)
