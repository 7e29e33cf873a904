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
    assert cache.disk.flush(timeout=30)
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
    got = cache.acquire(cache.match(ks))
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
