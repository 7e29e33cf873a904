"""Issue 9, item 1: every CPU read of a host slot waits for the copy into it.

The cache runs with Transfer(deferred=True): each device -> host copy snapshots its page and
writes the slot 0.5-3 ms later on another thread, as a copy queued on a CUDA stream would. A
path that reads a slot without waiting (the old protocol: a fence cleared the flag sync_host
checked) then hands the disk writer stale bytes, which it checksums and stores as if they were
the block -- these tests read every block back from every tier and compare bit for bit.
Real LMDB and zstd under tmp_path.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from storage.config import CacheConfig
from storage.tiered_cache import TieredKVCache
from storage.transfer import Transfer
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import same_bits


def deferred_cache(path: Path, pages: int, host_slots: int, write_policy: str = "write_back") -> TieredKVCache:
    config = CacheConfig(block_size=TINY.block_size, device_memory=pages * TINY.nbytes,
                         host_memory=host_slots * TINY.nbytes, disk_dir=str(path), disk_capacity=64 << 20,
                         write_policy=write_policy)
    return TieredKVCache(TINY, config, num_pages=pages, transfer=Transfer(torch.device("cpu"), deferred=True))


def compute(cache: TieredKVCache, ks) -> None:
    """The engine's path for new blocks, one at a time: allocate (may evict), write, register, release."""
    for k in ks:
        page = cache.allocate(1)[0]
        cache.pool.kv[page].copy_(block_data(k, cache.layout))
        cache.register(page, k)
        cache.release([page])


def assert_every_tier_exact(cache: TieredKVCache, ks) -> None:
    assert cache.disk.drain(timeout=30)
    cache.transfer.sync_host()
    for slot, k in cache.host.blocks():
        assert same_bits(cache.host.slab[slot], block_data(k)), f"host slot {slot} holds wrong bytes"
    on_disk = 0
    for k in ks:
        got = cache.disk.get(k)
        if got is not None:
            on_disk += 1
            assert same_bits(got.view(TINY.shape), block_data(k)), "the disk stored stale bytes as the block"
    assert on_disk > 0
    got = cache.load_now(cache.match(ks))
    assert len(got.pages) > 0
    for page, k in zip(got.pages, ks):
        assert same_bits(cache.pool.kv[page], block_data(k))
    cache.release(got.pages)
    cache.audit()


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_cascade_through_a_small_host_tier_stores_exact_bytes(tmp_path, write_policy) -> None:
    # 3 pages and 2 host slots: nearly every allocation evicts a page into host and a host slot
    # to disk while the copy into that slot may still be in flight.
    ks = keys(40)
    cache = deferred_cache(tmp_path / "disk", pages=3, host_slots=2, write_policy=write_policy)
    try:
        compute(cache, ks)
        assert cache.stats()["disk"].demotions >= 30
        assert_every_tier_exact(cache, ks)
    finally:
        cache.close()


def test_flush_and_demote_beside_new_blocks_store_exact_bytes(tmp_path) -> None:
    ks = keys(60)
    cache = deferred_cache(tmp_path / "disk", pages=6, host_slots=4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def background() -> None:
        try:
            while not stop.is_set():
                cache.flush()
                cache.demote("device")
                cache.demote("host")
        except BaseException as e:   # surfaced below: a failure here must fail the test
            errors.append(e)
    t = threading.Thread(target=background)
    t.start()
    try:
        compute(cache, ks)
    finally:
        stop.set()
        t.join(60)
    try:
        assert not errors, errors
        assert_every_tier_exact(cache, ks)
        assert cache.flush().complete
        for k in ks:      # after a complete flush every block is on disk, and exact
            got = cache.disk.get(k)
            assert got is not None and same_bits(got.view(TINY.shape), block_data(k))
    finally:
        cache.close()


def test_a_fence_does_not_count_as_the_hosts_wait(tmp_path) -> None:
    """The old bug in one step: copy into a slot, fence (device-side only), then evict the slot
    to disk. The disk must get the block's bytes, not the slot's previous content."""
    ks = keys(3)
    cache = deferred_cache(tmp_path / "disk", pages=1, host_slots=1)
    try:
        compute(cache, ks[:1])
        for k in ks[1:]:
            page = cache.allocate(1)[0]      # evicts the page's block into the only host slot...
            cache.transfer.fence()
            cache.pool.kv[page].copy_(block_data(k))
            cache.register(page, k)
            cache.release([page])
        cache.demote("device")               # ...and each one pushes the slot's block to disk
        cache.demote("host")
        assert_every_tier_exact(cache, ks)
        for k in ks:
            got = cache.disk.get(k)
            assert got is not None and same_bits(got.view(TINY.shape), block_data(k))
    finally:
        cache.close()


def compute_batched(cache: TieredKVCache, ks, n: int) -> None:
    """The engine's prefill path: `n` pages at a time, so one allocation evicts a batch."""
    for start in range(0, len(ks), n):
        batch = ks[start:start + n]
        pages = cache.allocate(len(batch))
        for page, k in zip(pages, batch):
            cache.pool.kv[page].copy_(block_data(k, cache.layout))
            cache.register(page, k)
        cache.release(pages)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_batched_evictions_larger_than_the_host_tier_store_exact_bytes(tmp_path, write_policy) -> None:
    """An allocation of 8 pages evicts 8 blocks in one batch of copies into a 3-slot host tier:
    the batch is split so a slot reserved by the batch is never evicted to disk before its copy
    is even issued (the disk would store the slot's previous bytes)."""
    ks = keys(64)
    cache = deferred_cache(tmp_path / "disk", pages=8, host_slots=3, write_policy=write_policy)
    try:
        compute_batched(cache, ks, 8)
        # Every eviction is copied into host (the host tier holds 3, so none is there already);
        # write-through also copies each block once when it is registered.
        assert cache.pool.evictions == 56
        assert cache.stats()["host"].demotions == 56 + (64 if write_policy == "write_through" else 0)
        assert_every_tier_exact(cache, ks)
        assert cache.flush().complete
        for k in ks:
            got = cache.disk.get(k)
            assert got is not None and same_bits(got.view(TINY.shape), block_data(k)), k
    finally:
        cache.close()


def test_write_through_never_waits_for_the_copy_it_just_issued(tmp_path) -> None:
    """register() under write-through copies the block to host and returns without waiting for
    that copy (on CUDA it would wait for the forward that wrote the page); the disk gets the
    block once the copy is done, exact."""
    ks = keys(6)
    cache = deferred_cache(tmp_path / "disk", pages=8, host_slots=8, write_policy="write_through")
    held = threading.Event()
    try:
        page = cache.allocate(1)[0]
        cache.pool.kv[page].copy_(block_data(ks[0]))
        cache.transfer._late.submit(held.wait, 60)     # the one late-copy thread: the copy waits behind this
        cache.register(page, ks[0])
        # Its copy is still in flight: register did not wait; the write-behind's worker waits for
        # it and writes the block down once it is done.
        try:
            with cache.tiers.lock:
                assert cache.cascade.writeback.busy(ks[0])
        finally:
            held.set()
        cache.release([page])
        compute(cache, ks[1:])
        assert cache.flush().complete and cache.cascade.writeback.wait_idle(0)
        for k in ks:
            got = cache.disk.get(k)
            assert got is not None and same_bits(got.view(TINY.shape), block_data(k)), k
        cache.audit()
    finally:
        cache.close()
