"""The host tier: one preallocated slab of block slots in host memory.

Knows: hash -> slot, LRU order of slots, capacity in bytes (whole blocks), and how many readers
each slot has now (a fill copying it into a page with no lock held). The slab is pinned
when CUDA is available so device <-> host copies can run asynchronously on a copy stream; it is
exactly the slots' size (storage/pinned.py: not rounded up to a power of two), and pageable
with `pinned: false` in stats when the OS refuses to lock it.
Doesn't know: the device pool or the disk -- a full slab hands its LRU block to `on_evict`
(the path to disk) before the slot is reused.

A block's life in a slot: `reserve` (findable: a reader waits for the copy announced for the slot,
storage/transfer.py), the copy in issued by the caller, `commit` (readable: said), then evicted or
removed. KV events (storage/kv_events/sink.py, medium CPU; `events`, NO_EVENTS unless the cache
publishes): said here, one sink call per batch -- `commit` says BlockStored for the slots of a
batch whose copies are issued, `evict_lru` (after `on_evict` returned: the block reached the tier
below's queue first) and `remove`/`remove_many` say BlockRemoved, only for a block whose
BlockStored was said: a reserved block whose copy failed is removed unsaid. Threads: the
caller's, under the tiers' lock (storage/tiers.py); a sink call never blocks.

NOTE invariant (issue 18): a slot with readers (`pin`) is never evicted, removed to the free list
or handed out by `reserve` to another block, so its bytes stay put while it is read with the tiers' lock free.
Enforced here: `evict_lru` skips pinned slots (the LRU unpinned block goes instead), `remove` of
a pinned block forgets its key but keeps the slot out of the free list until its last `unpin`,
and `reserve` answers None when every slot is pinned (the caller sends the block elsewhere).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from storage.layout import BlockLayout
from storage.hashing import BlockKey
from storage.kv_events.sink import HOST_MEDIUM, NO_EVENTS, NoEvents
from storage.pinned import host_buffer


@dataclass(frozen=True, slots=True)
class HostStats:
    capacity_bytes: int
    used_bytes: int
    slots: int
    blocks: int
    evictions: int
    pinned: bool


class HostTier:
    def __init__(self, layout: BlockLayout, capacity_bytes: int, pin: bool | None = None,
                 on_evict: Callable[[BlockKey, int], None] | None = None,
                 device: torch.device | None = None, events: NoEvents = NO_EVENTS) -> None:
        self.layout = layout
        self.num_slots = layout.blocks_in(capacity_bytes)
        if pin is None:
            pin = torch.cuda.is_available()
        self._buffer = host_buffer(self.num_slots * layout.nbytes, bool(pin and self.num_slots > 0), device)
        self.pinned = self._buffer.pinned
        self.pinned_bytes = self._buffer.pinned_bytes
        self.slab = self._buffer.tensor.view(layout.dtype).view(self.num_slots, *layout.shape)
        self.on_evict = on_evict
        self.events = events
        self._keys: list[BlockKey | None] = [None] * self.num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, LRU first
        self._free: deque[int] = deque(range(self.num_slots))
        self._readers: list[int] = [0] * self.num_slots      # per slot: pins not yet unpinned
        self._pinned = 0                   # slots with readers
        self._orphans: set[int] = set()    # slots whose block left while read: free at the last unpin
        self._gen = [0] * self.num_slots   # per slot: bumped whenever its block leaves it
        self._said = [False] * self.num_slots   # per slot: its block's BlockStored was said (commit)
        self.evictions = 0
        # Retention (storage/cache_retention.py): a block `keep(key, slot)` says is retained (and
        # not yet held below) is passed over by evict_lru (moved to the MRU end) -- unless every
        # unpinned block is: then the LRU one goes anyway (the slab's capacity wins).
        self.keep: Callable[[BlockKey, int], bool] | None = None

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def __len__(self) -> int:
        return len(self._lru)

    def slot_of(self, block: BlockKey) -> int | None:
        slot = self._lru.get(block.hash)
        if slot is None or self._keys[slot].token_ids != block.token_ids:
            return None
        return slot

    def touch(self, block: BlockKey) -> None:
        """A hit: the block becomes most recently used."""
        self._lru.move_to_end(block.hash)

    def hashes(self) -> list[bytes]:
        """Blocks in LRU order (least recent first)."""
        return list(self._lru)

    def blocks(self) -> list[tuple[int, BlockKey]]:
        """(slot, key) of every block, in LRU order (least recent first)."""
        return [(slot, self._keys[slot]) for slot in self._lru.values()]

    def pin(self, slot: int) -> None:
        """A reader of `slot` (a copy out of it, made with no lock held) starts: until its
        `unpin`, the slot keeps its bytes (never evicted, freed or reserved for another block)."""
        self._readers[slot] += 1
        self._pinned += self._readers[slot] == 1

    def unpin(self, slot: int) -> None:
        """A reader of `slot` is done (its copy out is complete)."""
        assert self._readers[slot] > 0, f"host slot {slot} unpinned more often than pinned"
        self._readers[slot] -= 1
        if self._readers[slot] == 0:
            self._pinned -= 1
            if slot in self._orphans:
                self._orphans.discard(slot)
                self._free.append(slot)

    def generation(self, slot: int) -> int:
        """A number that changes whenever the slot's block leaves it (evicted, removed): a reader
        that copied the slot with no lock held and no pin keeps its copy only if the slot still
        holds the same block with the same generation afterwards (storage/host_writeback.py)."""
        return self._gen[slot]

    def readers(self, slot: int) -> int:
        return self._readers[slot]

    def reservable(self) -> int:
        """Slots a `reserve` could hand out now (free, or holding an unpinned block): a batch of
        at most this many reserves never evicts a slot the same batch reserved."""
        return self.num_slots - self._pinned

    def reserve(self, block: BlockKey) -> int | None:
        """A slot for `block` (its old slot if it is already here: callers look it up first, and a
        block present is never rewritten in place). Evicts the LRU unpinned block
        when full; the caller copies the bytes into `self.slab[slot]`, then `commit`s it. None when
        every slot is pinned by a reader (the block does not fit now)."""
        if not self.enabled:
            raise RuntimeError("host tier is disabled (host_memory=0)")
        slot = self._lru.get(block.hash)
        if slot is not None:
            self._lru.move_to_end(block.hash)
            return slot
        if not self._free and not self.evict_lru():
            return None
        slot = self._free.popleft()
        self._keys[slot] = block
        self._lru[block.hash] = slot
        return slot

    def commit(self, slots: Sequence[int]) -> list[BlockKey]:
        """The copies into these reserved slots are issued (announced to readers): their blocks
        are readable, one BlockStored. A slot whose block left meanwhile (removed while its copy
        ran), or committed already, says nothing. Returns the blocks said."""
        out = []
        for slot in slots:
            key = self._keys[slot]
            if key is not None and not self._said[slot]:
                self._said[slot] = True
                out.append(key)
        self.events.stored(out, HOST_MEDIUM)
        return out

    def evict_lru(self) -> bool:
        """Evict the least recently used block no reader pins now and no retention keeps (through
        `on_evict`), else the least recently used unpinned one. False when every block is pinned."""
        # NOTE invariant: capacity holds because a slot is only reused after its block left, and
        # a pinned slot is skipped: its reader's copy is still running (see the module's note).
        kept: list[bytes] = []
        h = None
        for cand, slot in self._lru.items():
            if self._readers[slot]:
                continue
            if self.keep is not None and self.keep(self._keys[slot], slot):
                kept.append(cand)         # retained: passed over, to the MRU end below
                continue
            h = cand
            break
        if h is None and kept:
            h = kept.pop(0)               # every unpinned block is kept: the LRU one goes anyway
        for k in kept:
            self._lru.move_to_end(k)
        if h is None:
            return False
        slot = self._lru.pop(h)
        key = self._keys[slot]
        if self.on_evict is not None:
            self.on_evict(key, slot)     # the slot's bytes are intact until this returns
        said = self._leave(slot)
        self._free.append(slot)
        self.evictions += 1
        if said:
            self.events.removed([h], HOST_MEDIUM)
        return True

    def _leave(self, slot: int) -> bool:
        """The slot's block leaves it (its index entry is gone already); whether it was said."""
        said, self._said[slot] = self._said[slot], False
        self._keys[slot] = None
        self._gen[slot] += 1
        return said

    def remove(self, block_hash: bytes) -> bool:
        """Forget a block. A pinned slot joins the free list only at its last unpin."""
        return self.remove_many([block_hash]) == 1

    def remove_many(self, hashes: Sequence[bytes]) -> int:
        """`remove` each block here; one BlockRemoved for those said. Returns the blocks removed."""
        gone, n = [], 0
        for h in hashes:
            slot = self._lru.pop(h, None)
            if slot is None:
                continue
            n += 1
            if self._leave(slot):
                gone.append(h)
            if self._readers[slot]:
                self._orphans.add(slot)
            else:
                self._free.append(slot)
        self.events.removed(gone, HOST_MEDIUM)
        return n

    def stats(self) -> HostStats:
        n = len(self._lru)
        return HostStats(capacity_bytes=self.num_slots * self.layout.nbytes, used_bytes=n * self.layout.nbytes,
                         slots=self.num_slots, blocks=n, evictions=self.evictions, pinned=self.pinned)

    def close(self) -> None:
        """Give the slab back (unpinned). NOTE: the caller has waited for every copy into it."""
        self.slab = torch.empty((0, *self.layout.shape), dtype=self.layout.dtype)
        self._buffer.close()
        self.pinned, self.pinned_bytes = False, 0

    def audit(self) -> None:
        assert len(self._lru) + len(self._free) + len(self._orphans) == self.num_slots, "host slots leaked or doubled"
        assert not set(self._free) & set(self._lru.values()), "a slot is both free and used"
        assert not set(self._free) & self._orphans and not self._orphans & set(self._lru.values())
        assert all(self._readers[slot] for slot in self._orphans), "a removed slot outlived its readers"
        assert not any(self._readers[slot] for slot in self._free), "a free slot has readers"
        assert self._pinned == sum(1 for n in self._readers if n), "pinned slots miscounted"
        for h, slot in self._lru.items():
            assert self._keys[slot] is not None and self._keys[slot].hash == h
        assert not any(self._said[slot] for slot in (*self._free, *self._orphans)), "a gone block is still said"
