"""Retention (issue 39, item 1) over real tiers: real LMDB under tmp_path, real zstd, the eviction
cascade as the engine drives it. A retained chain survives a flood of unretained blocks 5x the
disk's capacity and a restart; its deadline passes (an injected clock) and it is ordinary LRU
again; one tenant's retention never exceeds its bound nor evicts another's; where there is no
disk the host slab keeps it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.config import CacheConfig
from storage.hashing import BlockKey
from storage.retention import WRITE_AHEAD, RetainRow, Retention
from storage.tiered_cache import TieredKVCache
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import fill, same_bits

BLOCK = TINY.nbytes


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(path: Path | None, clock: Clock, disk_blocks: int = 40, host_slots: int = 4, pages: int = 4,
         **kw) -> TieredKVCache:
    config = CacheConfig(block_size=TINY.block_size, device_memory=pages * BLOCK, host_memory=host_slots * BLOCK,
                         disk_dir=None if path is None else str(path), disk_capacity=disk_blocks * BLOCK,
                         codec="raw", disk_reserve=0, **kw)
    return TieredKVCache(TINY, config, num_pages=pages, clock=clock)


def flood(cache: TieredKVCache, blocks: int, start: int) -> None:
    """`blocks` distinct unretained blocks computed, released, and pushed down the tiers."""
    for i in range(0, blocks, 2):
        ks = keys(2, start_token=start + i * TINY.block_size)
        cache.release(fill(cache, ks))
        if cache.disk is not None and i % 16 == 0:
            assert cache.disk.drain(timeout=60)
    if cache.disk is not None:
        cache.flush(timeout=60)


def held_on_disk(cache: TieredKVCache, ks: list[BlockKey]) -> int:
    assert cache.disk.drain(timeout=60)
    stored = {b.hash for b in cache.disk.iter_blocks()}
    return sum(k.hash in stored for k in ks)


def test_the_book_bounds_each_tenant_and_everyone_and_refreshes() -> None:
    clock = Clock()
    r = Retention(BLOCK, max_bytes=6 * BLOCK, per_tenant_bytes=4 * BLOCK, clock=clock)
    a, b = keys(5), keys(5, start_token=1000)
    got = r.retain("a", a, "5m")
    assert (got.retained, got.refused) == (4, 1)          # a's bound: 4 blocks; the 5th and after refused
    assert got.block_seconds == 4 * 300
    got = r.retain("b", b, "1h")
    assert (got.retained, got.refused) == (2, 3)          # everyone's bound: 6 blocks
    clock.t += 100
    got = r.retain("a", a[:2], "1h")                       # a refresh moves the deadline on
    assert got.retained == 2 and got.block_seconds == pytest.approx(2 * (3600 + 100 - 300))
    # the disk is told a little past the deadline, so the next refreshes write nothing
    assert got.rows and all(row.deadline == clock.t + 3600 * (1 + WRITE_AHEAD) for row in got.rows)
    got = r.retain("a", a[:2], "5m")                       # a shorter ask buys nothing
    assert got.retained == 2 and got.block_seconds == 0 and not got.rows
    clock.t += 10
    got = r.retain("a", a[:2], "1h")                       # a refresh within the write-ahead: no row
    assert got.block_seconds == pytest.approx(2 * 10) and not got.rows
    clock.t -= 10
    assert r.tenants()["a"].blocks == 4 and r.tenants()["b"].blocks == 2
    clock.t += 301 - 100 + 1                               # a[2:4] (5m) passed; a[:2] (1h) not
    assert [r.live(k.hash) for k in a[:4]] == [True, True, False, False]
    assert r.tenants()["a"].blocks == 2
    clock.t += 3600
    assert r.blocks() == 0 and r.tenants() == {}


def test_a_retained_chain_survives_a_flood_5x_the_disk_and_a_restart_then_expires(tmp_path: Path) -> None:
    clock = Clock()
    disk_blocks = 40
    retained = keys(8, start_token=10_000)
    cache = make(tmp_path / "kv", clock, disk_blocks=disk_blocks)
    try:
        assert cache.retain("alice", retained, "1h").retained == 8
        for i in range(0, 8, 4):                            # computed after the ask: written through
            cache.release(fill(cache, retained[i:i + 4]))
        flood(cache, 5 * disk_blocks, start=0)
        assert held_on_disk(cache, retained) == 8
        assert cache.disk.stats().used_bytes <= disk_blocks * BLOCK   # the capacity bound held
        status = cache.retention_status()
        assert status["keeper"] == "disk" and status["tenants"]["alice"]["blocks"] == 8
    finally:
        cache.close()
    clock.t += 1800                                         # half the hour, across a restart
    cache = make(tmp_path / "kv", clock, disk_blocks=disk_blocks)
    try:
        assert cache.retention.blocks() == 8                # deadlines read back from the disk
        flood(cache, 5 * disk_blocks, start=100_000)
        assert held_on_disk(cache, retained) == 8
        got = cache.disk.get_many(retained)
        assert all(same_bits(g, block_data(k)) for g, k in zip(got, retained))
        clock.t += 1801 + WRITE_AHEAD * 3600                # past the deadline the disk was given: ordinary LRU
        assert cache.retention.blocks() == 0
        flood(cache, 2 * disk_blocks, start=200_000)
        assert held_on_disk(cache, retained) == 0
    finally:
        cache.close()


def test_one_tenants_retention_neither_passes_its_bound_nor_evicts_anothers(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(tmp_path / "kv", clock, disk_blocks=40, max_retained=20 * BLOCK,
                 max_retained_per_tenant=8 * BLOCK)
    try:
        bob = keys(6, start_token=50_000)
        assert cache.retain("bob", bob, "5m").retained == 6
        cache.release(fill(cache, bob[:4]))
        cache.release(fill(cache, bob[4:]))
        greedy = keys(12, start_token=60_000)
        got = cache.retain("eve", greedy, "24h")
        assert (got.retained, got.refused) == (8, 4)        # her bound, not bob's blocks
        for i in range(0, 12, 4):
            cache.release(fill(cache, greedy[i:i + 4]))
        flood(cache, 200, start=0)
        assert held_on_disk(cache, bob) == 6
        assert held_on_disk(cache, greedy[:8]) == 8
        assert cache.retention_status()["tenants"]["eve"]["bytes"] == 8 * BLOCK
    finally:
        cache.close()


def test_without_a_disk_the_host_slab_keeps_retained_blocks(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(None, clock, host_slots=16, pages=4)
    try:
        assert cache.retention_status()["keeper"] == "host"
        retained = keys(4, start_token=70_000)
        assert cache.retain("alice", retained, "5m").retained == 4
        cache.release(fill(cache, retained))
        flood(cache, 80, start=0)
        held = {h for h in cache.host.hashes()}
        assert all(k.hash in held for k in retained)
        clock.t += 301
        flood(cache, 40, start=100_000)
        held = {h for h in cache.host.hashes()}
        assert not any(k.hash in held for k in retained)
        cache.audit()
    finally:
        cache.close()


def test_with_no_tier_below_the_device_every_ask_is_refused() -> None:
    cache = make(None, Clock(), host_slots=0, pages=4)
    try:
        got = cache.retain("alice", keys(3), "1h")
        assert (got.retained, got.refused) == (0, 3)
        assert cache.retention_status()["enabled"] is False
    finally:
        cache.close()


def test_max_retained_must_stay_below_the_keeping_tier(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_retained"):
        make(tmp_path / "kv", Clock(), disk_blocks=40, max_retained=40 * BLOCK)


def test_the_capacity_bound_wins_over_rows_a_larger_configuration_wrote(tmp_path: Path) -> None:
    """Rows on disk retaining more than this configuration's disk holds (written by a server with a
    bigger disk): the store still never commits past its capacity; retained blocks go, oldest first."""
    clock = Clock()
    retained = keys(30, start_token=90_000)
    big = make(tmp_path / "kv", clock, disk_blocks=80)
    try:
        assert big.retain("alice", retained, "24h").retained == 30
        for i in range(0, 30, 4):
            big.release(fill(big, retained[i:i + 4]))
        assert held_on_disk(big, retained) == 30
    finally:
        big.close()
    small = make(tmp_path / "kv", clock, disk_blocks=20)
    try:
        assert small.disk.stats().capacity_bytes == 20 * BLOCK
        assert small.retention.blocks() == 10          # half the smaller disk; the 20 others forgotten on disk too
        flood(small, 60, start=0)
        assert small.disk.stats().used_bytes <= small.disk.stats().capacity_bytes
        assert held_on_disk(small, retained) == 10     # exactly what this configuration retains
        assert small.disk.stats().moved_aside == 0 and not list(tmp_path.glob("kv.damaged*"))
    finally:
        small.close()
    again = make(tmp_path / "kv", clock, disk_blocks=20)
    try:                                               # the disk's rows now say what the book said
        assert len({r.block_hash for r in again.disk.retained_rows()}) == 10
    finally:
        again.close()


def test_a_disk_of_nothing_but_retained_blocks_still_keeps_its_capacity(tmp_path: Path) -> None:
    """Every stored block retained and the store over its bound (a commit of retained blocks past
    the capacity): the walk passes every block over once, then evicts retained blocks, oldest
    first -- the capacity wins, and the store is healthy (not declared damaged for the walk's moves)."""
    from storage.codec.payload import Codec
    from storage.disk.tier import DiskTier
    from tests.storage.disk_tier_child import make_block, make_key
    clock = Clock()
    size = len(make_block(0, dtype=torch.float32).numpy().tobytes())
    with DiskTier(str(tmp_path / "kv"), 20 * size + 20 * 256, codec=Codec(kind="raw"), reserve_bytes=None) as t:
        t.open_retention(clock)
        ks = [make_key(i) for i in range(30)]
        t.retain([RetainRow(k.hash, "alice", clock.t + 3600, "1h") for k in ks])
        for i in range(0, 30, 5):
            for j in range(i, i + 5):
                t.put(ks[j], make_block(j, dtype=torch.float32))
            assert t.drain(timeout=60)
        s = t.stats()
        assert s.used_bytes <= s.capacity_bytes and s.moved_aside == 0
        held = {b.hash for b in t.iter_blocks()}
        assert 0 < len(held) < 30 and {k.hash for k in ks[-5:]} <= held     # the newest kept, the oldest went
        assert t.check() == []


def test_refreshes_neither_pile_up_nor_rewrite_until_the_write_ahead_passes() -> None:
    clock = Clock()
    r = Retention(BLOCK, max_bytes=64 * BLOCK, per_tenant_bytes=64 * BLOCK, clock=clock)
    chain = keys(8)
    first = r.retain("a", chain, "5m")
    assert len(first.rows) == 8
    rows = 0
    for _ in range(1000):                       # a hot prefix: a hit every 100 ms for 100 s
        clock.t += 0.1
        rows += len(r.retain("a", chain, "5m").rows)
    # rows only each time the write-ahead (2% of 5 min = 6 s) ran out: ~100 s / 6 s times 8 blocks
    assert 8 * 14 <= rows <= 8 * 18
    assert len(r._heap) == 8                    # one entry per block and tenant, however many refreshes
    assert not r.retain("a", chain, "5m").rows  # within the write-ahead: nothing to write ...
    # ... unless the disk said it lost them: then the next ask writes them again
    r.unwritten([RetainRow(k.hash, "a", r._written[(k.hash, "a")], "5m") for k in chain])
    assert len(r.retain("a", chain, "5m").rows) == 8
    clock.t += 301 + 6
    assert r.blocks() == 0 and r._heap == []
