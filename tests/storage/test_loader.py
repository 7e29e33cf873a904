"""The loader's page protocol (storage/loader.py) over a real LMDB disk tier and real zstd: a
request that goes away mid-load gives its pages back while the fill ends safely on its own
reference; two plans share one fill; a block that leaves the disk between plan and fill cuts
the prefix; prefetch moves disk blocks into the host tier and is billed as disk."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from storage.disk.tier import DiskTier
from storage.hit_account import HitAccount
from tests.storage.conftest import block_data, keys
from tests.storage.test_tiered_cache import fill, make_cache, same_bits


@pytest.fixture
def held_reads(monkeypatch):
    """DiskTier.get_many waits for `gate` before its real read (the bytes are the real ones)."""
    gate = threading.Event()
    real = DiskTier.get_many
    monkeypatch.setattr(DiskTier, "get_many", lambda tier, ks, outs=None: (gate.wait(10), real(tier, ks, outs))[1])
    return gate


def disk_only(tmp_path: Path, n: int, pages: int = 6, host_slots: int = 0):
    ks = keys(n)
    cache = make_cache(tmp_path / "disk", pages=pages, host_slots=host_slots)
    cache.release(fill(cache, ks))
    assert cache.flush().complete
    cache.drop("device")
    cache.drop("host")
    return cache, ks


def test_a_request_gone_mid_load_gives_its_pages_back_and_the_fill_ends_safely(tmp_path, held_reads) -> None:
    cache, ks = disk_only(tmp_path, 3)
    try:
        load = cache.start_load(cache.match(ks))
        assert load.pending and not load.ready()
        assert [cache.pool.refcount(p) for p in load.pages] == [2, 2, 2]    # the fill's + the request's
        cache.cancel_load(load)
        assert [cache.pool.refcount(p) for p in load.pages] == [1, 1, 1]    # the fills still hold them
        assert cache.pool.stats().free_pages == 3
        held_reads.set()
        assert load.wait(10)
        cache.audit()
        p = cache.pool.stats()
        assert (p.in_use_pages, p.cached_blocks) == (0, 3)    # filled pages became cached blocks
        for page, k in zip(load.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        again = cache.load_now(cache.match(ks))
        assert again.tiers == ("device",) * 3 and list(again.pages) == load.pages
        cache.release(again.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()


def test_two_plans_share_one_fill_per_block(tmp_path, held_reads) -> None:
    cache, ks = disk_only(tmp_path, 3)
    try:
        first = cache.start_load(cache.match(ks))
        second = cache.start_load(cache.match(ks[:2]))
        assert second.pages == first.pages[:2] and second.fills == first.fills[:2]
        assert [cache.pool.refcount(p) for p in first.pages] == [3, 3, 2]
        held_reads.set()
        assert first.wait(10) and second.wait(10)
        a, b = cache.finish_load(first), cache.finish_load(second)
        assert a.tiers == ("disk",) * 3 and b.tiers == ("disk",) * 2
        assert cache.stats()["disk"].promotions == 3 and cache.stats()["disk"].hits == 5
        cache.release(a.pages + b.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()


def test_a_block_gone_between_plan_and_fill_cuts_the_prefix(tmp_path, held_reads) -> None:
    cache, ks = disk_only(tmp_path, 3)
    try:
        load = cache.start_load(cache.match(ks))
        assert cache.disk.delete(ks[1])          # another process evicted it meanwhile
        held_reads.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) and same_bits(cache.pool.kv[got.pages[0]], block_data(ks[0]))
        p = cache.pool.stats()
        assert (p.in_use_pages, p.cached_blocks, p.free_pages) == (1, 2, 4)   # k1's page is free
        cache.release(got.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()


def test_prefetch_moves_disk_blocks_into_host_and_a_plan_bills_them_as_disk(tmp_path) -> None:
    cache, ks = disk_only(tmp_path, 3, host_slots=8)
    try:
        hits = HitAccount()
        pre = cache.prefetch(ks, hits)
        assert pre.wait(10)
        assert set(hits.moved) == {k.hash for k in ks}
        assert [cache.host.slot_of(k) is not None for k in ks] == [True] * 3
        assert cache.prefetch(ks).chunks == []              # nothing left to prefetch
        load = cache.start_load(cache.match(ks), hits)
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) * 3
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        # Someone else's prefetch is not this request's: the same blocks from host bill as host.
        cache.drop("device")
        other = cache.load_now(cache.match(ks))
        assert other.tiers == ("host",) * 3
        cache.release(other.pages)
        cache.audit()
    finally:
        cache.close()


def test_prefetch_takes_at_most_half_the_host_tier(tmp_path) -> None:
    cache, ks = disk_only(tmp_path, 6, pages=8, host_slots=4)
    try:
        hits = HitAccount()
        pre = cache.prefetch(ks, hits)
        assert pre.wait(10)
        assert len(hits.moved) == 2 and len(cache.host) == 2
        cache.audit()
    finally:
        cache.close()


def test_a_fill_waits_for_a_started_prefetch_chunk_and_claims_the_rest(tmp_path, monkeypatch, held_reads) -> None:
    monkeypatch.setattr("storage.prefetch.PREFETCH_CHUNK", 1)
    cache, ks = disk_only(tmp_path, 3, host_slots=8)
    read: list[bytes] = []
    real = DiskTier.get_many
    monkeypatch.setattr(DiskTier, "get_many", lambda tier, keys, outs=None: (read.extend(k.hash for k in keys),
                                                                            real(tier, keys, outs))[1])
    try:
        hits = HitAccount()
        pre = cache.prefetch(ks, hits)           # chunk k0 starts (its read is held); k1, k2 wait
        while not pre.chunks[0].started:
            time.sleep(0.001)
        load = cache.start_load(cache.match(ks), hits)
        # The fill claims k1 and k2 before k0's read is let go: else the prefetch worker may
        # start k1's chunk first (a loaded machine schedules the fill's thread late).
        deadline = time.monotonic() + 10
        while any(k.hash in cache.loader.prefetching for k in ks[1:]) and time.monotonic() < deadline:
            time.sleep(0.001)
        held_reads.set()
        assert load.wait(10) and pre.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) * 3        # k0 via its own prefetch: still billed as disk
        assert sorted(read) == sorted(k.hash for k in ks), "every block is read exactly once"
        assert set(hits.moved) == {ks[0].hash}    # the fill claimed k1 and k2 from the prefetch
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()


def test_staged_disk_fills_put_each_block_in_its_own_page(tmp_path, held_reads, monkeypatch) -> None:
    """The GPU path's bookkeeping, run on the CPU: disk fills decode parts of 3 blocks into two
    staging halves in turn and are copied from there into their pages; a block missing mid-part
    leaves its page unfilled and every other block lands in its own page, exact."""
    monkeypatch.setattr("storage.loader.STAGE_BLOCKS", 3)
    cache, ks = disk_only(tmp_path, 8, pages=10)
    try:
        cache.loader.stage_decodes = True
        load = cache.start_load(cache.match(ks))
        assert cache.disk.delete(ks[4])          # the second chunk's middle block
        held_reads.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) * 4
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        for k in ks[5:]:                              # filled, then cached past the cut
            page = cache.pool.page_of(k)
            assert page is not None and same_bits(cache.pool.kv[page], block_data(k))
        assert cache.pool.page_of(ks[4]) is None
        cache.release(got.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()
