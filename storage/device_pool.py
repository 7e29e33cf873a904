"""The paged KV pool on the model's device: one preallocated tensor of pages.

Two layouts of the same pages, one view: `kv` is always [page, layer, k/v, slot, kv_head, head_dim]
and `kv[page]` is the page's block in the order it serializes (storage/layout.py), so every tier
copies the same bytes either way. Page-major (the default): a page's block is contiguous (one copy
per block). Layer-major (`by_layer`): the memory is [layer, page, ...] and `kv` a permuted view of
it, so each layer's pages are one contiguous region (`kv[:, layer]`) -- what flex_paged's 32-bit
kernel offsets address when the whole pool is past 2^31 elements (`attention_span`); a block is
then strided (torch copies it; a CPU decode goes through staging, storage/loader.py).

Knows: which pages are free, which hold a cached block (hash -> page), how many sequences use
each page (refcounts), and the LRU order of cached pages nobody uses. Doesn't know: the host or
disk tiers -- eviction hands the evicted blocks to `on_evict` (the demotion path), all of one
allocation in one call (so their copies out go as one batch), before any of their pages is reused.

KV events (storage/kv_events/sink.py, medium GPU; `events`, NO_EVENTS unless the cache publishes):
said here, at the index's two mutations, one sink call per batch -- a block registered
(`register`, `register_many`) is BlockStored, one evicted or dropped is BlockRemoved, said after
`on_evict` returned (its block reached the host's slot or the queue below first, so a router
never sees a block held nowhere that is still held). Threads: the caller's, under the tiers'
lock (storage/tiers.py): the pool has no lock of its own; a sink call never blocks.

Page states:
  free       refcount 0, no block            -> in `_free` (FIFO, so page ids are predictable)
  in use     refcount > 0, maybe a block      -> in neither list; never evicted
  evictable  refcount 0, holds a cached block -> in `_evictable` (LRU first), found by lookup
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from storage.layout import BlockLayout
from storage.hashing import BlockKey
from storage.kv_events.sink import DEVICE_MEDIUM, NO_EVENTS, NoEvents


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity_bytes: int
    used_bytes: int       # pages in use or holding a cached block
    pages: int
    free_pages: int
    in_use_pages: int
    cached_blocks: int
    evictions: int


class DevicePool:
    def __init__(self, layout: BlockLayout, num_pages: int, device: str | torch.device = "cpu",
                 on_evict: Callable[[list[tuple[BlockKey, int]]], None] | None = None,
                 events: NoEvents = NO_EVENTS, by_layer: bool = False) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: need at least 1 page, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.by_layer = by_layer
        # [page, layer, k/v, slot, kv_head, head_dim]: one page holds one block of every layer.
        if by_layer:
            memory = torch.zeros((layout.num_layers, num_pages, *layout.shape[1:]), dtype=layout.dtype,
                                 device=self.device)
            self.kv = memory.transpose(0, 1)
        else:
            self.kv = torch.zeros((num_pages, *layout.shape), dtype=layout.dtype, device=self.device)
        self.on_evict = on_evict
        self.events = events
        self._ref = [0] * num_pages
        self._key: list[BlockKey | None] = [None] * num_pages
        self._index: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._gen = [0] * num_pages        # per page: bumped whenever its block leaves it
        self.evictions = 0

    @staticmethod
    def attention_span(layout: BlockLayout, num_pages: int, by_layer: bool) -> int:
        """The KV elements one layer's attention view of such a pool spans (what flex_paged's
        kernels address from the view's start): the whole pool page-major (a layer's rows are
        spread over every page), one layer's region layer-major. Shapes only: nothing allocated."""
        return num_pages * layout.numel // (layout.num_layers if by_layer else 1)

    # ---- queries -------------------------------------------------------------------------
    def page_of(self, block: BlockKey) -> int | None:
        """The page caching this block, or None. Tokens are compared too, not just the hash."""
        page = self._index.get(block.hash)
        if page is None or self._key[page].token_ids != block.token_ids:
            return None
        return page

    def key_of(self, page: int) -> BlockKey | None:
        return self._key[page]

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def generation(self, page: int) -> int:
        """A number that changes whenever the page's block leaves it (evicted, dropped): a reader
        that copied the page with no lock held (Cascade's copies out) keeps its copy only if the
        page still holds the same block with the same generation afterwards."""
        return self._gen[page]

    @property
    def num_free(self) -> int:
        """Pages an allocation can take right now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def evictable_pages(self) -> list[int]:
        """Cached, unused pages in eviction order (LRU first)."""
        return list(self._evictable)

    def cached_pages(self) -> list[int]:
        return list(self._index.values())

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, holding no block. Takes free pages first, then evicts LRU."""
        if not self.can_allocate(n):
            raise RuntimeError(f"device pool: cannot allocate {n} pages ({self.num_free} available)")
        pages, victims = [], []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                victims.append(page)
            pages.append(page)
        self._evict(victims)
        for page in pages:
            self._ref[page] = 1
        return pages

    def _evict(self, pages: list[int]) -> None:
        # NOTE invariant: only pages from `_evictable` (refcount 0) reach here, so a page with
        # refcount > 0 is never evicted. The blocks are handed to the demotion path, in eviction
        # order and in one call, before any of the pages is reused, while their bytes are intact.
        if not pages:
            return
        victims = []
        for page in pages:
            key = self._key[page]
            assert key is not None and self._ref[page] == 0
            victims.append((key, page))
        if self.on_evict is not None:
            self.on_evict(victims)
        for key, page in victims:
            del self._index[key.hash]
            self._key[page] = None
            self._gen[page] += 1
        self.evictions += len(victims)
        self.events.removed([key.hash for key, _ in victims], DEVICE_MEDIUM)

    def acquire(self, page: int) -> None:
        """One more user of a cached page (a prefix hit); it stops being evictable."""
        if self._ref[page] == 0:
            if page not in self._evictable:
                raise RuntimeError(f"device pool: page {page} is free, not cached; cannot acquire it")
            del self._evictable[page]
        self._ref[page] += 1

    def register(self, page: int, block: BlockKey) -> bool:
        """Mark an in-use page as holding `block`. False (page stays uncached) when another page
        already caches the same block, e.g. two sequences computed the same prefix at once."""
        return self.register_many([(page, block)])[0]

    def register_many(self, blocks: Sequence[tuple[int, BlockKey]]) -> list[bool]:
        """`register` for each (page, block), in order; the blocks newly findable are one
        BlockStored (a fill's chain: one event)."""
        out, new = [], []
        for page, block in blocks:
            if self._ref[page] < 1:
                raise RuntimeError(f"device pool: page {page} is not in use; register pages you hold")
            if self._key[page] is not None:
                if self._key[page].hash == block.hash:
                    out.append(True)
                    continue
                raise RuntimeError(f"device pool: page {page} already holds another block")
            if block.hash in self._index:
                out.append(False)
                continue
            self._index[block.hash] = page
            self._key[page] = block
            new.append(block)
            out.append(True)
        self.events.stored(new, DEVICE_MEDIUM)
        return out

    def release(self, page: int) -> None:
        """One user fewer. At 0 a cached page becomes evictable (most recently used), others free."""
        if self._ref[page] < 1:
            raise RuntimeError(f"device pool: page {page} released more often than acquired")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if self._key[page] is not None:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def evict(self, pages: list[int]) -> None:
        """Evict unused cached pages now (through `on_evict`, in one batch, like an allocation)."""
        for page in pages:
            if page not in self._evictable:
                raise RuntimeError(f"device pool: page {page} is in use or not cached; cannot evict it")
        if len(set(pages)) != len(pages):
            raise ValueError(f"device pool: pages to evict repeat: {pages}")
        for page in pages:
            del self._evictable[page]
        self._evict(pages)
        self._free.extend(pages)

    def drop(self, pages: Sequence[int]) -> None:
        """Forget the cached blocks of unused pages without demoting them (used by drop_tier):
        one BlockRemoved."""
        for page in pages:
            if self._ref[page] != 0 or page not in self._evictable:
                raise RuntimeError(f"device pool: page {page} is in use or not cached; cannot drop it")
        if len(set(pages)) != len(pages):
            raise ValueError(f"device pool: pages to drop repeat: {pages}")
        hashes = []
        for page in pages:
            del self._evictable[page]
            hashes.append(self._key[page].hash)
            del self._index[self._key[page].hash]
            self._key[page] = None
            self._gen[page] += 1
            self._free.append(page)
        self.events.removed(hashes, DEVICE_MEDIUM)

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> PoolStats:
        # O(1): every page is free, evictable (cached, refcount 0) or in use (audit() checks it).
        in_use = self.num_pages - len(self._free) - len(self._evictable)
        used_pages = self.num_pages - len(self._free)
        return PoolStats(capacity_bytes=self.num_pages * self.layout.nbytes,
                         used_bytes=used_pages * self.layout.nbytes, pages=self.num_pages,
                         free_pages=len(self._free), in_use_pages=in_use,
                         cached_blocks=len(self._index), evictions=self.evictions)

    def audit(self) -> None:
        """Check every bookkeeping invariant; raises AssertionError on the first violation."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert not (free & evictable), "a page is both free and evictable"
        for page in range(self.num_pages):
            ref, key = self._ref[page], self._key[page]
            assert ref >= 0
            if page in free:
                assert ref == 0 and key is None, f"free page {page} has ref {ref} / key"
            elif page in evictable:
                assert ref == 0 and key is not None, f"evictable page {page} has ref {ref} / no key"
            else:
                assert ref > 0, f"page {page} is lost: ref 0, neither free nor evictable"
            if key is not None:
                assert self._index.get(key.hash) == page, f"index does not point at page {page}"
        assert len(self._index) == sum(k is not None for k in self._key)
