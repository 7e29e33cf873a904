"""TieredKVCache: the one object the engine talks to about KV blocks.

Knows: the four tiers (device pool, host slab, disk, and the optional shared remote store),
where each block lives, and how blocks move: lookups walk a prompt's block chain and take the
fastest tier holding each block; promotion is planned here (pages held) and done by the loader
(storage/loader.py) on its own threads; eviction cascades device -> host -> disk -> remote
(write-back by default, or write-through).
Doesn't know: models, sequences or requests -- the engine hands in BlockKeys and page ids and
gets typed results back.

Thread safety: every public method takes one lock, so the engine thread, HTTP threads (lookup,
status), the loader's threads and the disk writer thread (inside DiskTier) can run at once.
NOTE invariant: the engine thread never reads or decodes a disk block (plan() only holds pages;
test: tests/engine/test_async_restore.py). The lock
is never held while waiting on the disk writer: the eviction cascade queues for disk without
waiting (a full queue drops the block, counted), and flush/demote("host") copy blocks out under
the lock in small batches and hand them to the writer (which may wait) outside it, so the
engine's next allocate/register never waits for a flush.

The remote tier (storage/remote/tier.py) is network I/O, so NOTE: nothing under the cache lock
and nothing on the engine thread talks to it. Whether the store holds a prompt's blocks is asked
by a probe the loader runs when the request is submitted (prefetch()); match() then reads the
probe's answer from memory. Remote blocks are read by the loader like disk blocks, and written
by the remote writer's thread: blocks the disk writer commits are forwarded to it (compressed
once), and with no disk tier a block falling out of the lowest local tier is queued to it.
"""
from __future__ import annotations

import threading
from collections import deque
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from storage.codec.payload import Codec
from storage.device_pool import DevicePool
from storage.disk.tier import DiskTier
from storage.host_tier import HostTier
from storage.loader import Fill, Load, Loader, Prefetch, RemoteProbe
from storage.layout import BlockLayout
from storage.transfer import Transfer
from storage.remote.breaker import BreakerConfig
from storage.config import CacheConfig
from storage.remote.tier import RemoteTier
from storage.hashing import BlockKey

TIERS = ("device", "host", "disk", "remote")
_FLUSH_BATCH = 32     # blocks copied out per hold of the lock by flush/demote


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
            out[tier] += block_size
        return out


@dataclass(frozen=True, slots=True)
class Acquired:
    """Device pages now held (refcount +1) for a matched prefix, with each block's source tier.
    May be shorter than the match: a disk block that fails verification ends the prefix."""
    pages: tuple[int, ...]
    tiers: tuple[str, ...]
    restore_s: float


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What a flush did: blocks written down, and whether every one of them (and every write
    already queued) is now committed. complete=False is the truth after a dropped write (no room
    even after evicting, an I/O error) or a timeout; the drops are in disk stats' write_errors."""
    written: int
    complete: bool
    remote: bool | None = None   # every remote write sent (None: no remote tier)

    def to_dict(self) -> dict:
        d = {"written": self.written, "complete": self.complete}
        if self.remote is not None:
            d["remote"] = self.remote
        return d


@dataclass
class TierStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0            # blocks served from this tier to a request
    promotions: int = 0      # blocks copied from this tier into device pages
    demotions: int = 0       # blocks written into this tier from the tier above
    evictions: int = 0       # blocks that left this tier for lack of room
    bytes_read: int = 0
    bytes_written: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class TieredKVCache:
    def __init__(self, layout: BlockLayout, config: CacheConfig, device: str | torch.device = "cpu",
                 num_pages: int | None = None, disk: DiskTier | None = None, transfer: Transfer | None = None,
                 remote: RemoteTier | None = None) -> None:
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
        self._lock = threading.RLock()
        self.transfer = transfer or Transfer(self.device)   # tests pass Transfer(deferred=True)
        self.pool = DevicePool(layout, num_pages, self.device, on_evict=self._demote_from_device)
        self.host = HostTier(layout, config.host_bytes, pin=self.device.type == "cuda",
                             on_evict=self._demote_from_host)
        if disk is None and config.disk_path is not None:
            disk = DiskTier(config.disk_path, config.disk_bytes, Codec(config.zstd_level),
                            layout=layout)
        self.disk = disk
        if remote is None and config.remote is not None:
            remote = RemoteTier(config.remote, layout, Codec(config.zstd_level),
                                timeout_s=config.remote_timeout_s, ttl_s=config.remote_ttl_s,
                                breaker=BreakerConfig(cooldown_s=config.remote_retry_s))
        self.remote = remote
        if remote is not None and disk is not None:
            disk.on_commit(self._forward_to_remote)
        self.write_through = config.write_policy == "write_through"
        # Write-through blocks copied to host whose disk write waits for that copy (engine thread,
        # under the lock): queued for disk once their copy is done, never waited for on a step.
        self._through: deque[tuple[BlockKey, int]] = deque()
        self.remote_through = config.remote_write == "write_through"
        self._stats = {t: TierStats() for t in TIERS}
        self.loader = Loader(self)

    # ---- lookup --------------------------------------------------------------------------
    def _tier_of(self, key: BlockKey) -> str | None:
        if self.pool.lookup(key) is not None:
            return "device"
        if self.host.enabled and self.host.lookup(key) is not None:
            return "host"
        if self.disk is not None and self.disk.contains(key.hash):
            return "disk"
        return None

    def match(self, keys: Sequence[BlockKey], remote: frozenset[bytes] | None = None) -> CacheMatch:
        """Which tier holds each block of the chain, up to the first block none holds.
        `remote`: the hashes a probe found in the remote store (RemoteProbe.hashes); without it
        no block is a remote hit. Read-only: promotes nothing, counts nothing, no I/O."""
        with self._lock:
            found = []
            for key in keys:
                tier = self._tier_of(key)
                if tier is None and remote and key.hash in remote:
                    tier = "remote"
                if tier is None:
                    break
                found.append((key, tier))
            return CacheMatch(tuple(found))

    def lookup(self, keys: Sequence[BlockKey]) -> CacheMatch:
        """match() with the remote store asked now (a round trip on the calling thread: never
        call it from the engine thread). For lookups that promote nothing (Engine.lookup)."""
        local = self.match(keys)
        if self.remote is None or len(local) == len(keys) or not self.remote.available():
            return local
        return self.match(keys, self.remote.probe(keys[len(local):]))

    # ---- promotion -----------------------------------------------------------------------
    def plan(self, match: CacheMatch, prefetch: Prefetch | None = None) -> Load:
        """Hold device pages for a matched prefix and start filling the host/disk ones on the
        loader (storage/loader.py). Returns at once: no copy, read or decode happens here.

        A device hit is acquired; a block another request is filling now shares that fill's
        page; any other block gets a new page (refcount: the fill's and the request's), left
        unregistered until filled. Stops early (a shorter prefix) when the pool is out of pages
        or the block left every tier since match(). `prefetch`: blocks that request's own
        prefetch brought from disk into the host tier are billed as disk hits.
        """
        with self._lock:
            pages: list[int] = []
            tiers: list[str] = []
            fills: list[Fill | None] = []
            new: list[Fill] = []
            for key, tier in match.blocks:
                page = self.pool.lookup(key)
                if page is not None:
                    self.pool.acquire(page)
                    pages.append(page)
                    tiers.append("device")
                    fills.append(None)
                    continue
                fill = self.loader.inflight.get(key.hash)
                if fill is None or fill.key.token_ids != key.token_ids:
                    if not self.pool.can_allocate(1):
                        break
                    # Allocate first, then look the block up: the allocation may evict a device
                    # page whose demotion pushes this very block out of a full host tier.
                    page = self.pool.allocate(1)[0]     # the fill's reference
                    source = self._source_of(key) or (tier if tier == "remote" else None)
                    if source is None:
                        self.pool.release(page)
                        break   # the block left every tier since match(): the prefix ends here
                    fill = Fill(key, page, source)
                    self.loader.inflight[key.hash] = fill
                    new.append(fill)
                self.pool.acquire(fill.page)            # the request's reference
                tier = fill.source
                if tier == "host" and prefetch is not None and key.hash in prefetch.moved:
                    tier = "disk"
                pages.append(fill.page)
                tiers.append(tier)
                fills.append(fill)
            # NOTE: pages just allocated may still be copying their evicted blocks out (CUDA):
            # the loader's stream waits for those copies before it writes the pages (a mark, not
            # a CPU wait here: the copies wait for the forward in flight).
            self.loader.start(new, after=self.transfer.issued() if new else None)
            return Load(pages, tiers, fills)

    def _source_of(self, key: BlockKey) -> str | None:
        if self.host.enabled and self.host.lookup(key) is not None:
            return "host"
        if self.disk is not None and self.disk.contains(key.hash):
            return "disk"
        return None

    def finish_load(self, load: Load) -> Acquired:
        """A ready Load (load.ready()) as the prefix its request keeps: pages up to the first
        block that failed to fill (a damaged or vanished block ends the prefix; the request
        computes the rest), the pages after it given back."""
        with self._lock:
            cut = next((i for i, f in enumerate(load.fills) if f is not None and not f.ok), len(load.fills))
            for page in load.pages[cut:]:
                self.pool.release(page)
            for tier in load.tiers[:cut]:
                self._stats[tier].hits += 1
            return Acquired(tuple(load.pages[:cut]), tuple(load.tiers[:cut]), time.perf_counter() - load.started)

    def cancel_load(self, load: Load) -> None:
        """The request behind a Load is gone: give its pages back now. Fills in flight finish on
        their own references (their pages become cached blocks or free pages when done)."""
        self.release(load.pages)

    def acquire(self, match: CacheMatch) -> Acquired:
        """plan() and wait for it: device pages for a matched prefix, filled (tests, tools)."""
        load = self.plan(match)
        load.wait()
        return self.finish_load(load)

    def prefetch(self, keys: Sequence[BlockKey]) -> Prefetch:
        """Start reading a new request's disk blocks into the host tier (or, with no host tier,
        into the OS page cache), so its time in the queue overlaps the drive. At most half the
        host tier per request, so one long prompt cannot flush everyone's host blocks.
        With a remote tier, the blocks after the last local one are probed for in the store (on
        a loader thread): the scheduler admits the request once the probe answered."""
        out = Prefetch()
        with self._lock:
            todo = []
            limit = self.host.num_slots // 2 if self.host.enabled else len(keys)
            missing = len(keys)
            for i, key in enumerate(keys):
                if self.pool.lookup(key) is not None or key.hash in self.loader.inflight:
                    continue
                if self.host.enabled and self.host.lookup(key) is not None:
                    continue
                if self.disk is None or not self.disk.contains(key.hash):
                    missing = i    # the chain's first block no local tier holds
                    break
                if key.hash not in self.loader.prefetching and len(todo) < limit:
                    todo.append(key)
            self.loader.prefetch(todo, out)
            if self.remote is not None and missing < len(keys) and self.remote.available():
                out.remote = RemoteProbe()
                self.loader.probe(keys[missing:], out.remote)
        return out

    # ---- new blocks ----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return self.pool.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        """n fresh device pages (refcount 1) for blocks about to be computed."""
        with self._lock:
            pages = self.pool.allocate(n)
            self.transfer.fence()  # evicted pages finished copying out before they are rewritten
            self._drain_through()
            return pages

    def register(self, page: int, key: BlockKey) -> bool:
        """A held page now holds a full computed block: make it findable. Under write-through
        (write_policy, or remote_write for the remote tier) the block is also copied to host
        now, and queued for disk (whose writer forwards it to the remote), or with no disk for
        the remote writer, once that copy is done (at the cache's next allocate/register, or a
        flush). False if another page already has it."""
        with self._lock:
            ok = self.pool.register(page, key)
            if ok and (self.write_through or (self.remote_through and self.remote is not None)):
                self._write_down([(key, page)], through=True)
            self._drain_through()
            return ok

    def release(self, pages: Sequence[int]) -> None:
        with self._lock:
            for page in pages:
                self.pool.release(page)

    # ---- demotion (the eviction cascade) --------------------------------------------------
    def _write_down(self, blocks: list[tuple[BlockKey, int]], through: bool = False) -> None:
        """Copy device blocks (key, page) into host unless already there (and, `through`, on
        down to disk or the remote writer)."""
        if not self.host.enabled:
            for key, page in blocks:
                self._to_disk(key, self.pool.kv[page])
            return
        copied = self._to_host(blocks)
        if through:
            # NOTE: not _host_to_disk now: its wait for the copy would wait for the forward that
            # wrote the page (issue 9, item 6). _drain_through queues it once the copy is done.
            self._through.extend(copied)

    def _to_host(self, blocks: list[tuple[BlockKey, int]]) -> list[tuple[BlockKey, int]]:
        """Copy device blocks (key, page) the host lacks into host slots, a batch of copies at a
        time. Returns the (key, slot) copied."""
        copied = []
        # A batch is at most the slab's size: reserving a slot evicts the LRU block, and within a
        # batch that must never be a slot the same batch reserved (its copy is not issued yet, so
        # the eviction's wait would not see it and disk would get the slot's stale bytes).
        step = max(1, self.host.num_slots)
        for start in range(0, len(blocks), step):
            batch = []
            for key, page in blocks[start:start + step]:
                if self.host.lookup(key) is not None:
                    continue
                slot = self.host.reserve(key)
                batch.append((slot, self.pool.kv[page]))
                copied.append((key, slot))
                self._count_write("host")
            self.transfer.copy_to_host(self.host.slab, batch)
        return copied

    def _drain_through(self, wait: bool = False) -> None:
        """Queue for disk the write-through blocks whose host copy is done (all, if `wait`)."""
        while self._through:
            key, slot = self._through[0]
            if not wait and not self.transfer.ready(slot):
                return              # copies complete in order: the rest are not done either
            self._through.popleft()
            if self.host.lookup(key) == slot:    # else evicted meanwhile, and its eviction queued it
                self._host_to_disk(key, slot)

    def _host_to_disk(self, key: BlockKey, slot: int) -> bool:
        """A host slot's block down to disk, or with no disk tier to the remote writer."""
        if self.disk.contains(key.hash) if self.disk is not None else self.remote is None:
            return False
        self.transfer.wait_host(slot)   # NOTE: the copy into the slot is complete before put reads it
        return self._to_disk(key, self.host.slab[slot])

    def _to_disk(self, key: BlockKey, src: torch.Tensor) -> bool:
        """Queue a block (a device page, or a host slot already waited for) for disk unless the
        disk has it; never waits (the caller holds the lock): a full queue drops it (disk stats'
        queue_full_drops). DiskTier.put copies the bytes, so `src` may be reused once this returns.
        With no disk tier the remote tier is the next one down: queued for its writer (same rules)."""
        if self.disk is None:
            return self.remote is not None and self.remote.put(key, src.cpu(), wait=False)
        if self.disk.contains(key.hash):
            return False
        if not self.disk.put(key, src.cpu(), wait=False):   # .cpu(): the tensor itself on CPU
            return False
        self._count_write("disk")
        return True

    def _copies_out(self, host_only: bool = False, skip: Callable[[BlockKey], bool] = lambda key: False
                    ) -> Iterator[list[tuple[BlockKey, torch.Tensor]]]:
        """Every cached block (device pages unless host_only, then host slots) copied to the CPU
        under the lock a batch at a time, each batch yielded with no lock held (the caller may
        wait on a writer). A block that moved or left meanwhile is taken from where it is now, or
        skipped (its own eviction queued it), as is one `skip(key)` (asked under the lock) names."""
        with self._lock:
            todo = [] if host_only else [self.pool.key_of(p) for p in self.pool.cached_pages()]
            todo += [key for _, key in self.host.blocks()]
        for start in range(0, len(todo), _FLUSH_BATCH):
            copies = []
            with self._lock:
                self.transfer.sync_host()
                for key in todo[start:start + _FLUSH_BATCH]:
                    if skip(key):
                        continue
                    page = None if host_only else self.pool.lookup(key)
                    slot = self.host.lookup(key) if page is None else None
                    src = self.pool.kv[page] if page is not None else (None if slot is None else self.host.slab[slot])
                    if src is not None:
                        copies.append((key, src.to("cpu", copy=True)))
            yield copies

    def _copy_down_to_disk(self, host_only: bool = False) -> int:
        """Every cached block the disk lacks (device pages unless host_only, then host slots)
        queued for disk, waiting on the writer with no lock held. Returns blocks queued."""
        written = 0
        for copies in self._copies_out(host_only, skip=lambda key: self.disk.contains(key.hash)):
            queued = [key for key, block in copies if self.disk.put(key, block)]   # may wait: no lock held
            with self._lock:
                for _ in queued:
                    self._count_write("disk")
            written += len(queued)
        return written

    def _forward_to_remote(self, committed: list) -> None:
        """The disk writer committed these (key, payload, raw size): queue them for the remote
        (the write-behind). Runs on the disk writer's thread: waits for room in the remote queue at
        most one remote timeout in all, then drops (counted), so a slow store slows disk commits
        by a bounded amount and never stops them."""
        deadline = time.monotonic() + self.config.remote_timeout_s
        for key, payload, raw_size in committed:
            self.remote.put_encoded(key, payload, raw_size, wait=True, timeout=max(0.0, deadline - time.monotonic()))

    def _copy_down_to_remote(self) -> int:
        """With no disk tier: every cached device and host block queued for the remote writer
        (waiting for room there, a bounded time per block, no lock held). Returns blocks queued."""
        queued = 0
        timeout = self.config.remote_timeout_s * 4
        for copies in self._copies_out():
            queued += sum(self.remote.put(key, block, wait=True, timeout=timeout) for key, block in copies)
        return queued

    def _count_write(self, tier: str) -> None:
        st = self._stats[tier]
        st.demotions += 1
        st.bytes_written += self.layout.nbytes

    def _demote_from_device(self, blocks: list[tuple[BlockKey, int]]) -> None:
        # Called by the pool with one allocation's evicted blocks, while their pages are intact.
        self._write_down(blocks)

    def _demote_from_host(self, key: BlockKey, slot: int) -> None:
        # Called by the host tier before the slot is reused; compression happens off-thread.
        self._host_to_disk(key, slot)

    # ---- maintenance ---------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> FlushResult:
        """Push every cached block down to the lowest tier (disk, else host) and wait for the
        disk writer: after a complete flush a restarted process hits every block. With a remote
        tier, also wait for its writer: blocks the disk commits are forwarded to it; with no disk
        tier every device and host block is queued for it here. `remote` says whether every
        remote write was sent (a store that is down makes it False, never the flush fail)."""
        # The disk's commits forward blocks to the remote writer, which may fail a batch before
        # this flush waits for it: the mark makes such a loss count too.
        remote_mark = None if self.remote is None else self.remote.write_failures()
        with self._lock:
            self._drain_through(wait=True)
        if self.disk is not None:
            written = self._copy_down_to_disk()
            complete = self.disk.flush(timeout)
        elif self.remote is not None:
            written, complete = self._copy_down_to_remote(), True
        elif not self.host.enabled:
            return FlushResult(0, True)
        else:
            with self._lock:   # no disk tier: device blocks into the host slab (memcpy, no waiting)
                written = len(self._to_host([(self.pool.key_of(page), page) for page in self.pool.cached_pages()]))
                self.transfer.sync_host()
            complete = True
        remote = None if self.remote is None else self.remote.flush(timeout, since=remote_mark)
        return FlushResult(written, complete, remote)

    def demote(self, tier: str) -> int:
        """Evict every unused cached block of `tier` one step down the cascade (device -> host
        -> disk), exactly as capacity pressure would. Returns blocks evicted."""
        if tier not in ("device", "host"):
            raise ValueError(f"tier: can demote 'device' or 'host', got {tier!r}")
        if tier == "host" and self.disk is not None:
            self._copy_down_to_disk(host_only=True)   # the writes, outside the lock; then evict
        if tier == "device":
            # In batches: each eviction may cascade host -> disk (a put that never waits), so
            # between batches, holding no lock, wait for the writer's queue to have room: an
            # explicit demote never drops a block for a full queue, and never stalls the engine.
            evicted = 0
            while True:
                with self._lock:
                    pages = self.pool.evictable_pages()[:_FLUSH_BATCH]
                    self.pool.evict(pages)
                evicted += len(pages)
                if len(pages) < _FLUSH_BATCH:
                    return evicted
                if self.disk is not None:
                    self.disk.wait_for_room()
        with self._lock:
            n = len(self.host)
            for _ in range(n):
                self.host.evict_lru()
            return n

    def drop(self, tier: str) -> int:
        """Forget every cached block of one tier (device: only pages no sequence uses)."""
        if tier not in TIERS:
            raise ValueError(f"tier: expected one of {TIERS}, got {tier!r}")
        if tier == "remote":
            # Every server's blocks live there: clearing it is the store operator's call
            # (FLUSHDB, or its LRU and TTL), not one server's.
            raise ValueError("tier: the remote tier is shared by every server and is not dropped from one")
        with self._lock:
            if tier == "device":
                pages = self.pool.evictable_pages()
                for page in pages:
                    self.pool.drop(page)
                return len(pages)
            if tier == "host":
                hashes = self.host.hashes()
                for h in hashes:
                    self.host.remove(h)
                return len(hashes)
        if self.disk is None:
            return 0
        self.disk.flush()
        return self.disk.clear()

    def close(self) -> None:
        with self._lock:
            self._drain_through(wait=True)   # write-through blocks reach the disk writer's queue
        self.loader.close()        # fills and prefetches read the disk: they end first
        self.transfer.close()      # every copy into the host slab is complete...
        self.host.close()          # ...before it is unpinned
        if self.disk is not None:
            self.disk.close()      # its last commits are forwarded to the remote writer...
        if self.remote is not None:
            self.remote.close()    # ...which sends them (bounded) before it stops

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        """Per-tier counters, O(1) in the number of pages and blocks (/metrics reads this on every
        scrape). The disk's are read outside the cache lock: they need an LMDB read."""
        disk = self.disk.stats() if self.disk is not None else None
        remote = self.remote.stats() if self.remote is not None else None
        with self._lock:
            out = {t: TierStats(**{**self._stats[t].__dict__, "extra": {}}) for t in TIERS}
            p = self.pool.stats()
            out["device"].capacity_bytes, out["device"].used_bytes = p.capacity_bytes, p.used_bytes
            out["device"].blocks, out["device"].evictions = p.cached_blocks, p.evictions
            out["device"].extra = {"pages": p.pages, "free_pages": p.free_pages, "in_use_pages": p.in_use_pages}
            h = self.host.stats()
            out["host"].capacity_bytes, out["host"].used_bytes = h.capacity_bytes, h.used_bytes
            out["host"].blocks, out["host"].evictions = h.blocks, h.evictions
            out["host"].extra = {"pinned": h.pinned, "enabled": self.host.enabled}
            if disk is not None:
                d = disk
                o = out["disk"]
                o.capacity_bytes, o.used_bytes, o.blocks, o.evictions = d.capacity_bytes, d.used_bytes, d.blocks, d.evictions
                o.bytes_read = d.bytes_read
                o.extra = {"enabled": True, "compression_ratio": d.compression_ratio, "pending_writes": d.pending_writes,
                           "corrupt": d.corrupt, "write_errors": d.write_errors, "read_errors": d.read_errors,
                           "recovered": d.recovered,
                           "raw_bytes": d.raw_bytes,
                           "stored_bytes_written": d.bytes_written}
            else:
                out["disk"].extra = {"enabled": False}
            o = out["remote"]
            if remote is not None:
                # Capacity is the store's own (maxmemory + its eviction policy): not reported here.
                # hits/promotions/bytes_read are blocks served to requests (as for every tier);
                # the store client's own counters are in extra (reads, store_hits, ...).
                r = asdict(remote)
                o.demotions, o.bytes_written = r["writes"], r.pop("bytes_written")
                r["store_hits"], r["stored_bytes_read"] = r.pop("hits"), r.pop("bytes_read")
                o.extra = {**r, "write_policy": self.config.remote_write}
            else:
                o.extra = {"enabled": False}
            return out

    def audit(self) -> None:
        """Every tier's bookkeeping holds (used by tests after each step)."""
        with self._lock:
            self.pool.audit()
            self.host.audit()
            assert self.pool.stats().used_bytes <= self.pool.stats().capacity_bytes
            assert self.host.stats().used_bytes <= self.host.stats().capacity_bytes
