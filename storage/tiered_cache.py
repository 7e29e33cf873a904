"""TieredKVCache: the one object the engine talks to about KV blocks -- where they are.

Knows: placement. Which tier holds each block of a prompt's chain (match, lookup), fresh pages
and making them findable (allocate, register, release: storage tests and tools drive them), a new
request's disk prefetch (prefetch) and the probe of the tiers over a link (probe), and the per-tier
stats. A request's blocks -- the one boundary the engine's scheduler meets (plan, join, grow,
computed, finish; page ids stay in an opaque `RequestBlocks`) -- are storage/kv_blocks.py's.
Movement lives beside it: storage/cascade.py moves blocks down (eviction, write-through, and
the operator's flush/demote/drop, which this class only hands on), storage/loader.py moves them
up; both are given the narrow handle storage/tiers.py, never this object.
With `kv_events` configured it starts the KV-event publisher (storage/cache_events.py) and hands
its sink to every tier: each block that becomes or stops being findable anywhere is published.
Doesn't know: models, sequences or requests -- the engine hands in BlockKeys and a request's handle and
gets typed results back --, nor which tiers are below the host: they are built from the config by
storage/tier_wiring.py and walked in order through storage/lower_tier.py's verbs, each tier's
counters a record it reports itself (tests/storage/test_tier_boundary.py keeps this so).

Thread safety: every public method takes the tiers' one lock, so the engine thread, HTTP
threads (lookup, status), the loader's threads and the writers can run at once.
NOTE invariant: the engine thread never reads or decodes a disk block (plan() only holds pages;
test: tests/engine/test_async_restore.py) and never talks to a tier over a link: whether one
holds a prompt's blocks is asked by a probe the loader runs when the request is submitted
(probe()); match() then reads the probe's answer from memory.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Callable, Sequence

import torch

from storage.cache_events import CacheEvents
from storage.cache_retention import CacheRetention
from storage.cascade import Cascade
from storage.config import CacheConfig
from storage.device_pool import DevicePool
from storage.flush_result import FlushResult
from storage.hashing import BlockKey
from storage.hit_account import HitAccount
from storage.host_tier import HostTier
from storage.layout import BlockLayout
from storage.kv_blocks import BlockPlan, CacheMatch, KVBlocks, RequestBlocks
from storage.load_outcome import Acquired
from storage.load_records import ChainProbe, Prefetch, ProbeAnswer
from storage.loader import Loader
from storage.lower_tier import LowerTier
from storage.prefix_tree import CachedBlock
from storage.shared_pages import SharedPages
from storage.tier_wiring import NamedTiers, wire
from storage.tiers import TIERS, Tiers, TierStats
from storage.transfer import Transfer

log = logging.getLogger(__name__)

__all__ = ["TIERS", "Acquired", "BlockPlan", "CacheMatch", "FlushResult", "RequestBlocks", "TierStats", "TieredKVCache"]


class TieredKVCache(KVBlocks, SharedPages, CacheEvents, CacheRetention, NamedTiers):
    def __init__(self, layout: BlockLayout, config: CacheConfig, device: str | torch.device = "cpu",
                 num_pages: int | None = None, disk: LowerTier | None = None, transfer: Transfer | None = None,
                 remote: LowerTier | None = None, clock: Callable[[], float] | None = None,
                 pool_by_layer: bool = False) -> None:
        """`disk`, `remote`: tiers built already (tests, tools); else CacheConfig's are built
        (storage/tier_wiring.py). `clock`: wall-clock seconds for retention deadlines (tests).
        `pool_by_layer`: the device pool laid out layer-major (storage/device_pool.py)."""
        if layout.block_size != config.block_size:
            raise ValueError(f"layout block_size {layout.block_size} != config block_size {config.block_size}")
        self.layout = layout
        self.config = config
        self.device = torch.device(device)
        if num_pages is None:
            num_pages = layout.blocks_in(config.device_bytes)
            if num_pages < 2:
                raise ValueError(f"device_memory: {config.device_bytes} bytes holds {num_pages} blocks of "
                                 f"{layout.nbytes} bytes; need at least 2")
        self._wired = wired = wire(config, layout, disk, remote)
        self.events_publisher = None
        self._announcer: threading.Thread | None = None
        self._closing = threading.Event()
        self.tiers = Tiers(layout=layout,
                           pool=DevicePool(layout, num_pages, self.device, by_layer=pool_by_layer),
                           host=HostTier(layout, config.host_bytes, pin=self.device.type == "cuda",
                                         device=self.device),
                           transfer=transfer or Transfer(self.device),   # tests pass Transfer(deferred=True)
                           lower=wired.tiers)
        self._lock = self.tiers.lock
        self.pool, self.host, self.transfer = self.tiers.pool, self.tiers.host, self.tiers.transfer
        self.cascade = Cascade(self.tiers, write_through=wired.write_through,
                               link_timeout_s=config.remote_timeout_s)
        self.loader = Loader(self.tiers)
        self._start_retention(clock)       # storage/cache_retention.py: deadlines read back
        # A planner needs a figure before the first fill: a few ms of host copies and one decode.
        self.tiers.rates.calibrate(layout, wired.decoders, self.device)
        if config.kv_events is not None:
            try:
                self._publish_events()
            except BaseException:
                self.close()       # a taken port: the tiers' threads and files go with the error
                raise

    # ---- where blocks are ----------------------------------------------------------------
    def _tier_of(self, key: BlockKey, probed: ProbeAnswer | None = None) -> str | None:
        """The fastest tier holding the block: device, host, then each tier below in order (a
        tier that needs a probe answers from `probed`: its own probe's answer)."""
        if self.pool.page_of(key) is not None:
            return "device"
        if self.host.enabled and self.host.slot_of(key) is not None:
            return "host"
        for below in self.tiers.lower:
            if below.contains(key) if below.local else probed is not None and probed.holds(below.name, key.hash):
                return below.name
        return None

    def match(self, keys: Sequence[BlockKey], probed: ProbeAnswer | None = None) -> CacheMatch:
        """Which tier holds each block of the chain, up to the first block none holds.
        `probed`: what each tier over a link answered its probe (ChainProbe.answer); without it
        no block is a hit of such a tier. Read-only: promotes nothing, counts nothing, no I/O.
        With prefix caching off (CacheConfig.prefix_caching), nothing: no request reuses a block."""
        if not self.config.prefix_caching:
            return CacheMatch(())
        with self._lock:
            found = []
            for key in keys:
                tier = self._tier_of(key, probed)
                if tier is None:
                    break
                found.append((key, tier))
            return CacheMatch(tuple(found))

    def lookup(self, keys: Sequence[BlockKey]) -> CacheMatch:
        """match() with the tiers over a link asked now (a round trip on the calling thread: never
        call it from the engine thread). For lookups that promote nothing (Engine.lookup)."""
        local = self.match(keys)
        linked = [below for below in self.tiers.linked if below.available()]
        if not linked or len(local) == len(keys):
            return local
        return self.match(keys, probed=ProbeAnswer({below.name: below.probe(keys[len(local):]) for below in linked}))

    # ---- a request's blocks: plan, join, grow, finish (storage/kv_blocks.py) ----------------
    def prefetch(self, keys: Sequence[BlockKey], hits: HitAccount | None = None) -> Prefetch:
        """Start reading a new request's disk blocks into the host tier (or, with no host tier,
        into the OS page cache), so its time in the queue overlaps the drive. At most half the
        host tier per request, so one long prompt cannot flush everyone's host blocks. `hits`: the
        request's hit account, told what the prefetch moves (HitAccount.moved_up)."""
        hits = HitAccount() if hits is None else hits
        # Prefetches read this process's first own tier below (the disk).
        source = next((below for below in self.tiers.lower if below.local), None)
        out = Prefetch()
        with self._lock:
            todo, _ = self._held_here(keys, source)
            if todo:
                self.loader.prefetcher.start(source, todo, out, hits)
        return out

    def probe(self, keys: Sequence[BlockKey]) -> ChainProbe | None:
        """With tiers over a link (the store): ask them, on a loader thread, which of the chain's
        blocks after the last one this process holds they hold; the scheduler admits the request
        once the probe answered (engine/probe_wait.py). None: no such tier, or nothing to ask."""
        linked = [below for below in self.tiers.linked if below.available()]
        if not linked:
            return None
        source = next((below for below in self.tiers.lower if below.local), None)
        with self._lock:
            _, missing = self._held_here(keys, source)
            if missing == len(keys):
                return None
            out = ChainProbe()
            self.loader.probe(linked, keys[missing:], out)
        return out

    def _held_here(self, keys: Sequence[BlockKey], source: LowerTier | None) -> tuple[list[BlockKey], int]:
        """(The chain's blocks a prefetch reads from `source`: held only there, not in flight, not
        prefetched, at most half the host tier; the chain's first block this process holds
        nowhere.) Under the tiers' lock."""
        todo = []
        limit = self.host.num_slots // 2 if self.host.enabled else len(keys)
        for i, key in enumerate(keys):
            if self.pool.page_of(key) is not None or key.hash in self.loader.inflight:
                continue
            if self.host.enabled and self.host.slot_of(key) is not None:
                continue
            if source is None or not source.contains(key):
                return todo, i
            if key.hash not in self.loader.prefetching and len(todo) < limit:
                todo.append(key)
        return todo, len(keys)

    # ---- new blocks ----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return self.pool.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        """n fresh device pages (refcount 1) for blocks about to be computed."""
        with self._lock:
            pages = self.pool.allocate(n)
            self.transfer.fence()  # evicted pages finished copying out before they are rewritten
            return pages

    def register(self, page: int, key: BlockKey) -> bool:
        """A held page now holds a full computed block: make it findable. Under write-through
        (write_policy, or remote_write for the remote tier) the block is also copied to host
        now, and queued down once that copy is done (storage/cascade.py). False if another page
        already has it, or prefix caching is off (the page stays unregistered: freed at release)."""
        if not self.config.prefix_caching:
            return False
        with self._lock:
            ok = self.pool.register(page, key)     # BlockStored GPU when new (DevicePool says it)
            if ok:
                self.cascade.registered(key, page)
            return ok

    def release(self, pages: Sequence[int]) -> None:
        with self._lock:
            for page in pages:
                self.pool.release(page)

    # ---- the operator's moves (storage/cascade.py) ----------------------------------------
    def flush(self, timeout: float | None = None) -> FlushResult:
        """Every cached block down to the lowest tier, the writers waited for (Cascade.flush)."""
        return self.cascade.flush(timeout)

    def demote(self, tier: str) -> int:
        """Every unused block of `tier` one step down, as pressure would (Cascade.demote)."""
        return self.cascade.demote(tier)

    def drop(self, tier: str) -> int:
        """Forget every cached block of one tier (Cascade.drop)."""
        return self.cascade.drop(tier)

    def close(self, release_memory: bool = True) -> None:
        """Stop every thread and write what is queued. `release_memory=False` (an engine whose
        step is still running past its close deadline) leaves the host slab and the loader's
        staging pinned and mapped: a running step's copies may still target them, and unmapping
        memory a queued device copy writes is a crash; the OS takes them back at exit."""
        self._closing.set()
        if self._announcer is not None:
            self._announcer.join()     # it reads the disk
        self.cascade.writeback.wait_idle()   # write-through blocks reach the writers' queues
        self.cascade.writeback.close()
        self.loader.close(release_memory)   # fills and prefetches read the disk: they end first
        self.transfer.close()      # every copy into the host slab issued so far is complete...
        if release_memory:
            self.host.close()      # ...before it is unpinned
        for below in self.tiers.lower:
            below.close()          # in order: the disk's last commits are forwarded to the remote
                                   # writer, which sends them (bounded) before it stops
        if self.events_publisher is not None:
            # Last: the final commits' events go out. Then nothing here is findable any more.
            self.tiers.events.cleared()
            self.events_publisher.close()

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        """Per-tier counters, O(1) in the number of pages and blocks (/metrics reads this on every
        scrape). The tiers below report their own records (LowerTier.stats), read outside the
        cache lock: the disk's need an LMDB read."""
        records = [(below.name, below.stats()) for below in self.tiers.lower]
        with self._lock:
            out = {t: TierStats(**{**self.tiers.counters[t].__dict__, "extra": {}}) for t in self.tiers.counters}
            p = self.pool.stats()
            out["device"].capacity_bytes, out["device"].used_bytes = p.capacity_bytes, p.used_bytes
            out["device"].blocks, out["device"].evictions = p.cached_blocks, p.evictions
            out["device"].extra = {"pages": p.pages, "free_pages": p.free_pages, "in_use_pages": p.in_use_pages}
            h = self.host.stats()
            out["host"].capacity_bytes, out["host"].used_bytes = h.capacity_bytes, h.used_bytes
            out["host"].blocks, out["host"].evictions = h.blocks, h.evictions
            out["host"].extra = {"pinned": h.pinned, "enabled": self.host.enabled,
                                 "written_behind": self.cascade.writeback.written,
                                 "inline_writes": self.cascade.inline_writes}
            for name, record in records:
                record.report(out[name])
            for name, extra in self._wired.status.items():   # the config's word (an absent tier, a policy)
                out[name].extra.update(extra)
            return out

    def cached_blocks(self, namespaces: frozenset[bytes] | None = None,
                      max_disk_blocks: int = 20_000) -> tuple[list[CachedBlock], bool]:
        """Every block the device pool, the host slab and the tiers below list hold (in
        `namespaces`, or all), each once, in the fastest tier that holds it, and whether the walk
        below stopped at `max_disk_blocks` records read (a big disk tier is shown in part). The
        remote store lists none: its contents are the store's (`tieredkv inspect --remote-url`).
        The tiers below are read outside the cache lock, in chunks (LowerTier.iter_blocks)."""
        def wanted(ns: bytes) -> bool:
            return namespaces is None or ns in namespaces
        found: dict[bytes, CachedBlock] = {}
        with self._lock:
            for page in self.pool.cached_pages():
                k = self.pool.key_of(page)
                if k is not None and wanted(k.namespace):
                    found[k.hash] = CachedBlock(k.hash, k.parent, k.namespace, k.token_ids, "device")
            for _, k in self.host.blocks():
                if wanted(k.namespace) and k.hash not in found:
                    found[k.hash] = CachedBlock(k.hash, k.parent, k.namespace, k.token_ids, "host")
        truncated, read = False, 0
        for below in self.tiers.lower:
            try:
                for b in below.iter_blocks():
                    read += 1
                    if read > max_disk_blocks:
                        truncated = True
                        break
                    if wanted(b.namespace):
                        mem = found.get(b.hash)
                        found[b.hash] = (CachedBlock(b.hash, b.parent, b.namespace, b.token_ids, below.name, b.reads)
                                         if mem is None else replace(mem, reads=b.reads))
            except Exception as e:    # a closed or replaced store: the memory tiers are still shown
                log.warning("cached_blocks: the %s tier could not be read: %s", below.name, e)
                truncated = True
        return list(found.values()), truncated

    def audit(self) -> None:
        """Every tier's bookkeeping holds (used by tests after each step)."""
        with self._lock:
            self.pool.audit()
            self.host.audit()
            assert self.pool.stats().used_bytes <= self.pool.stats().capacity_bytes
            assert self.host.stats().used_bytes <= self.host.stats().capacity_bytes
