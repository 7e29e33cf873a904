"""TieredKVCache: the one object the engine talks to about KV blocks -- where they are.

Knows: placement. Which tier holds each block of a prompt's chain (match, lookup), holding
device pages for a matched prefix and handing the fills of the others to the loader (plan,
finish_load), fresh pages for computed blocks and making them findable (allocate, register,
release), a new request's disk prefetch (prefetch) and the probe of the tiers over a link
(probe), and the per-tier stats.
Movement lives beside it: storage/cascade.py moves blocks down (eviction, write-through, and
the operator's flush/demote/drop, which this class only hands on), storage/loader.py moves them
up; both are given the narrow handle storage/tiers.py, never this object.
With `kv_events` configured it starts the KV-event publisher (storage/cache_events.py) and hands
its sink to every tier: each block that becomes or stops being findable anywhere is published.
Doesn't know: models, sequences or requests -- the engine hands in BlockKeys and page ids and
gets typed results back --, nor which tiers are below the host: they are built from the config by
storage/tier_wiring.py and walked in order through storage/lower_tier.py's verbs, each tier's
counters a record it reports itself (tests/storage/test_tier_boundary.py keeps this so).

Thread safety: every public method takes the tiers' one lock, so the engine thread, HTTP
threads (lookup, status), the loader's threads and the writers can run at once.
NOTE invariant: the engine thread never reads or decodes a disk block (start_load() only holds pages;
test: tests/engine/test_async_restore.py) and never talks to a tier over a link: whether one
holds a prompt's blocks is asked by a probe the loader runs when the request is submitted
(probe()); match() then reads the probe's answer from memory.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
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
from storage.load_outcome import Acquired, finish
from storage.load_records import ChainProbe, Fill, Load, Prefetch, ProbeAnswer
from storage.loader import Loader
from storage.lower_tier import LowerTier
from storage.prefix_tree import CachedBlock
from storage.shared_pages import SharedPages
from storage.tier_wiring import NamedTiers, wire
from storage.tiers import TIERS, Tiers, TierStats
from storage.transfer import Transfer

log = logging.getLogger(__name__)

__all__ = ["TIERS", "Acquired", "CacheMatch", "FlushResult", "TierStats", "TieredKVCache"]


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """Per matched block (in prompt order): its key and the tier that holds it. Stops at the
    first block no tier holds, so `blocks` is always a prefix of the keys asked about."""
    blocks: tuple[tuple[BlockKey, str], ...]

    def __len__(self) -> int:
        return len(self.blocks)

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for _, tier in self.blocks:
            out[tier] = out.get(tier, 0) + block_size
        return out


class TieredKVCache(SharedPages, CacheEvents, CacheRetention, NamedTiers):
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

    # ---- promotion -----------------------------------------------------------------------
    def start_load(self, match: CacheMatch, hits: HitAccount | None = None) -> Load:
        """Hold device pages for a matched prefix and start filling the host/disk ones on the
        loader (storage/loader.py). Returns at once: no copy, read or decode happens here.

        A device hit is acquired; a block another request is filling now shares that fill's
        page; any other block gets a new page (refcount: the fill's and the request's), left
        unregistered until filled. Stops early (a shorter prefix) when the pool is out of pages
        or the block left every tier since match(). `hits`: the request's hit account
        (storage/hit_account.py), which gives each new fill its billed tier.
        NOTE: a block's billed tier is decided once, when its fill is made (HitAccount.tier_of), and
        carried on the fill (Fill.billed_tier): every request waiting for the fill is billed from it, and
        the loader counts the promotion from it, so hits and promotions per tier always agree.
        """
        hits = HitAccount() if hits is None else hits
        with self._lock:
            pages: list[int] = []
            tiers: list[str] = []
            fills: list[Fill | None] = []
            tokens: list[int] = []
            new: list[Fill] = []
            for key, tier in match.blocks:
                page = self.pool.page_of(key)
                if page is not None:
                    self.pool.acquire(page)
                    pages.append(page)
                    tiers.append("device")
                    fills.append(None)
                    tokens.append(len(key.token_ids))
                    continue
                fill = self.loader.inflight.get(key.hash)
                # A fill whose read was given up (no load waited for it) is never waited for again.
                if fill is None or fill.key.token_ids != key.token_ids or fill.given_up:
                    if not self.pool.can_allocate(1):
                        break
                    # Allocate first, then look the block up: the allocation may evict a device
                    # page whose demotion pushes this very block out of a full host tier.
                    page = self.pool.allocate(1)[0]     # the fill's reference
                    source = self._source_of(key, tier)
                    if source is None:
                        self.pool.release(page)
                        break   # the block left every tier since match(): the prefix ends here
                    fill = Fill(key, page, source, billed_tier=hits.tier_of(key, source))
                    self.loader.inflight[key.hash] = fill
                    new.append(fill)
                self.pool.acquire(fill.page)            # the request's reference
                self.loader.wait_for(fill)
                pages.append(fill.page)
                tiers.append(fill.billed_tier)
                fills.append(fill)
                tokens.append(len(key.token_ids))
            # NOTE: pages just allocated may still be copying their evicted blocks out (CUDA):
            # the loader's stream waits for those copies before it writes the pages (a mark, not
            # a CPU wait here: the copies wait for the forward in flight).
            self.loader.start(new, after=self.transfer.issued() if new else None)
            return Load(pages, tiers, fills, tokens)

    def _source_of(self, key: BlockKey, matched: str) -> str | None:
        """Where a fill planned now reads the block: the host, else a local tier below that
        holds it, else the tier that needs a probe if match() found it there."""
        if self.host.enabled and self.host.slot_of(key) is not None:
            return "host"
        for below in self.tiers.lower:
            if below.contains(key) if below.local else below.name == matched:
                return below.name
        return None

    def finish_load(self, load: Load, abandon: bool = False) -> Acquired:
        """A ready Load (load.ready()) as the prefix its request keeps: pages up to the first
        block that failed to fill (a damaged or vanished block ends the prefix; the request
        computes the rest), the pages after it given back. `abandon`: the load is not ready and
        its request stops waiting (its deadline passed): it keeps the blocks that arrived, up to
        the first that did not; the fills still running end on their own pages, never on the
        request's (storage/load_outcome.py)."""
        with self._lock:
            acquired = finish(self.tiers, load, abandon)
            given_up = self.loader.stop_waiting(load.fills)
        for read in given_up:     # no request waits for these reads: their bytes stop crossing the link
            read.cancel()
        return acquired

    def recomputed(self, blocks: Sequence[tuple[BlockKey, str]], hits: HitAccount | None = None) -> tuple[str, ...]:
        """Matched blocks a request recomputes by choice (compute-or-load, engine/restore_planner.py):
        the tier each is billed from -- the one match() found it in, by the request's hit account
        as start_load() would bill it (HitAccount.tier_of) -- counted as a hit and a recompute of that
        tier. Nothing is read, moved or held."""
        hits = HitAccount() if hits is None else hits
        with self._lock:
            out = []
            for key, found in blocks:
                tier = hits.tier_of(key, found)
                self.tiers.counters[tier].hits += 1
                self.tiers.counters[tier].hit_tokens += len(key.token_ids)
                self.tiers.counters[tier].recomputed += 1
                out.append(tier)
            return tuple(out)

    def cancel_load(self, load: Load) -> None:
        """The request behind a Load is gone: give its pages back now. Fills in flight finish on
        their own references (their pages become cached blocks or free pages when done); a remote
        read no other request waits for is cut off (storage/loader.py)."""
        with self._lock:
            for page in load.pages:
                self.pool.release(page)
            given_up = self.loader.stop_waiting(load.fills)
        for read in given_up:
            read.cancel()

    def load_now(self, match: CacheMatch) -> Acquired:
        """start_load() and wait for it: device pages for a matched prefix, filled (tests, tools)."""
        load = self.start_load(match)
        load.wait()
        return self.finish_load(load)

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
