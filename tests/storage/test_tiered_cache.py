"""TieredKVCache over tiny tiers (real LMDB under tmp_path, real zstd): the eviction cascade in
exact order, promotion back from every tier bit-identically, write-through, verification
failures at acquire, flush and reopen, drop/demote, exact stats, audit."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch

from storage.codec import block_batch
from storage.codec.stored_block import payload_binding
from storage.codec.payload import Codec
from storage.disk.tier import DiskTier
from storage.layout import BlockLayout
from storage.tiered_cache import CacheMatch, TieredKVCache
from tests.storage.conftest import TINY, block_data, keys
from storage.config import CacheConfig
from storage.hashing import BlockKey

DISK = 64 << 20


def make_cache(path: Path, pages: int, host_slots: int, disk_bytes: int = DISK, layout: BlockLayout = TINY,
               write_policy: str = "write_back", codec: str = "zstd", by_layer: bool = False) -> TieredKVCache:
    config = CacheConfig(block_size=layout.block_size, device_memory=pages * layout.nbytes,
                         host_memory=host_slots * layout.nbytes, disk_dir=str(path),
                         disk_capacity=disk_bytes, write_policy=write_policy, codec=codec)
    return TieredKVCache(layout, config, num_pages=pages, pool_by_layer=by_layer)


@pytest.fixture
def caches(tmp_path: Path):
    """make(pages, host_slots, ...) -> a cache on tmp_path/disk; every cache is closed at the end."""
    made: list[TieredKVCache] = []

    def make(pages: int, host_slots: int, **kw) -> TieredKVCache:
        made.append(make_cache(tmp_path / "disk", pages, host_slots, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def fill(cache: TieredKVCache, ks: list[BlockKey]) -> list[int]:
    """What the engine does for computed blocks: allocate pages, write the KV, register."""
    pages = cache.allocate(len(ks))
    for page, k in zip(pages, ks):
        cache.pool.kv[page].copy_(block_data(k, cache.layout))
        assert cache.register(page, k)
    return pages


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def names(ks: list[BlockKey]) -> dict[bytes, str]:
    return {k.hash: f"k{i}" for i, k in enumerate(ks)}


def on_device(cache: TieredKVCache, ks: list[BlockKey]) -> set[str]:
    n = names(ks)
    return {n[cache.pool.key_of(p).hash] for p in cache.pool.cached_pages()}


def on_host(cache: TieredKVCache, ks: list[BlockKey]) -> list[str]:
    n = names(ks)
    return [n[h] for h in cache.host.hashes()]


def on_disk(cache: TieredKVCache, ks: list[BlockKey]) -> list[str]:
    """Committed disk blocks, least recently used first."""
    assert cache.disk.drain(timeout=30)
    n = names(ks)
    return [n[b.hash] for b in sorted(cache.disk.iter_blocks(), key=lambda b: b.last_access)]


def tiers(m: CacheMatch, ks: list[BlockKey]) -> list[tuple[str, str]]:
    n = names(ks)
    return [(n[k.hash], t) for k, t in m.blocks]


def counts(cache: TieredKVCache, tier: str) -> tuple[int, int, int, int, int]:
    s = cache.stats()[tier]
    return s.hits, s.promotions, s.demotions, s.evictions, s.blocks


def check(cache: TieredKVCache) -> None:
    cache.audit()
    assert cache.disk.drain(timeout=30) and cache.disk.check() == []


def damage_payload(path: Path, h: bytes) -> None:
    """Flip one byte in the middle of a stored payload, behind the (closed) tier's back."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            v = bytearray(txn.get(h, db=db))
            v[len(v) // 2] ^= 0x10
            txn.put(h, bytes(v), db=db)
    finally:
        env.close()


def test_eviction_cascades_device_host_disk_in_lru_order(caches) -> None:
    ks = keys(8)
    sizes = [len(Codec().encode(block_data(k), payload_binding(k.hash, k.namespace))) for k in ks]
    cap = 2 * max(sizes)
    assert 3 * min(sizes) > cap                       # the disk holds exactly two blocks
    cache = caches(pages=2, host_slots=2, disk_bytes=cap)

    cache.release(fill(cache, ks[0:2]))               # device LRU: k0, k1
    pages = fill(cache, ks[2:4])                      # evicts k0 then k1 into the host
    assert pages == [0, 1]
    assert on_device(cache, ks) == {"k2", "k3"}
    assert on_host(cache, ks) == ["k0", "k1"]
    assert on_disk(cache, ks) == []

    cache.release(pages)
    cache.release(fill(cache, ks[4:6]))               # k2, k3 to host; host LRU k0, k1 to disk
    assert on_device(cache, ks) == {"k4", "k5"}
    assert on_host(cache, ks) == ["k2", "k3"]
    assert on_disk(cache, ks) == ["k0", "k1"]

    held = fill(cache, ks[6:8])                       # k4, k5 to host; k2, k3 to disk; disk drops k0, k1
    assert on_device(cache, ks) == {"k6", "k7"}
    assert on_host(cache, ks) == ["k4", "k5"]
    assert on_disk(cache, ks) == ["k2", "k3"]
    assert cache.disk.stats().used_bytes == sizes[2] + sizes[3] <= cap

    # (hits, promotions, demotions, evictions, blocks)
    assert counts(cache, "device") == (0, 0, 0, 6, 2)
    assert counts(cache, "host") == (0, 0, 6, 4, 2)
    assert counts(cache, "disk") == (0, 0, 4, 2, 2)
    assert cache.stats()["host"].bytes_written == 6 * TINY.nbytes
    assert tiers(cache.match(ks), ks) == []           # k0 is gone: nothing after it counts
    assert tiers(cache.match(ks[2:]), ks) == [("k2", "disk"), ("k3", "disk"), ("k4", "host"), ("k5", "host"),
                                               ("k6", "device"), ("k7", "device")]
    assert not cache.can_allocate(1)                  # both pages are held: nothing to evict
    cache.release(held)
    check(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("by_layer", [False, True], ids=["page_major", "layer_major"])
def test_acquire_promotes_from_every_tier_bit_identically(caches, dtype: torch.dtype, by_layer: bool) -> None:
    """Either pool layout (storage/device_pool.py): a layer-major page is strided, its block the same bytes."""
    layout = dataclasses.replace(TINY, dtype=dtype)
    ks = keys(6, layout=layout)
    cache = caches(pages=6, host_slots=2, layout=layout, by_layer=by_layer)
    assert cache.pool.kv.is_contiguous() != by_layer and cache.loader.stage_decodes == by_layer
    cache.release(fill(cache, ks[:4]))
    assert cache.demote("device") == 4                # host keeps k2, k3; k0, k1 go on to disk
    assert on_host(cache, ks) == ["k2", "k3"] and on_disk(cache, ks) == ["k0", "k1"]
    assert cache.pool.stats().free_pages == 6

    back = cache.load_now(cache.match([ks[2]]))        # k2 back on the device (host keeps a copy)
    assert (back.pages, back.tiers) == ((4,), ("host",))   # free pages are FIFO: 4, 5, 0, 1, 2, 3
    cache.release(back.pages)
    cache.release(fill(cache, [ks[5]]))               # k5 cached, but k4 is missing before it

    m = cache.match(ks)
    assert tiers(m, ks) == [("k0", "disk"), ("k1", "disk"), ("k2", "device"), ("k3", "host")]
    assert m.tokens_by_tier(layout.block_size) == {"device": 4, "host": 4, "disk": 8, "remote": 0}
    got = cache.load_now(m)
    assert got.pages == (0, 1, 4, 2)
    assert got.tiers == ("disk", "disk", "device", "host")
    for page, k in zip(got.pages, ks):
        assert same_bits(cache.pool.kv[page], block_data(k, layout))
        assert cache.pool.refcount(page) == 1 and cache.pool.page_of(k) == page
    # A promoted page is registered: the next match finds every block on the device.
    assert [t for _, t in cache.match(ks[:4]).blocks] == ["device"] * 4
    assert counts(cache, "device") == (1, 0, 0, 4, 5)
    assert counts(cache, "host") == (2, 2, 4, 2, 2)
    assert counts(cache, "disk") == (2, 2, 2, 0, 2)
    assert cache.stats()["host"].bytes_read == 2 * layout.nbytes
    assert cache.disk.stats().store_hits == 2
    cache.release(got.pages)
    check(cache)


def test_acquire_follows_a_block_its_own_allocation_pushed_from_host_to_disk(caches) -> None:
    ks = keys(3)
    cache = caches(pages=2, host_slots=1)
    cache.release(fill(cache, [ks[0]]))
    cache.demote("device")                            # host: k0
    cache.release(fill(cache, ks[1:3]))               # both pages cached, nothing free
    m = cache.match([ks[0]])
    assert tiers(m, ks) == [("k0", "host")]
    # The allocation evicts k1 into the host, which pushes k0 to disk: acquire finds it there.
    got = cache.load_now(m)
    assert got.tiers == ("disk",)
    assert same_bits(cache.pool.kv[got.pages[0]], block_data(ks[0]))
    assert on_host(cache, ks) == ["k1"] and on_device(cache, ks) == {"k0", "k2"}
    assert counts(cache, "disk")[:2] == (1, 1) and counts(cache, "host")[:2] == (0, 0)
    cache.release(got.pages)
    check(cache)


def test_write_through_writes_host_and_disk_at_register(caches) -> None:
    ks = keys(2)
    cache = caches(pages=2, host_slots=2, write_policy="write_through")
    pages = fill(cache, ks)
    assert on_host(cache, ks) == ["k0", "k1"]
    # Written down behind the engine (storage/host_writeback.py): queued once its worker ran.
    assert cache.cascade.writeback.wait_idle(30)
    assert all(cache.disk.contains(k) for k in ks)
    assert on_disk(cache, ks) == ["k0", "k1"]
    for k in ks:
        assert same_bits(cache.host.slab[cache.host.slot_of(k)], block_data(k))
        assert same_bits(cache.disk.get(k), block_data(k))
    assert counts(cache, "host")[2] == 2 and counts(cache, "disk")[2] == 2
    cache.release(pages)
    assert cache.demote("device") == 2                # already below: nothing is written twice
    assert counts(cache, "host")[2:] == (2, 0, 2) and counts(cache, "disk")[2:4] == (2, 0)
    check(cache)


def test_write_through_without_host_writes_disk(caches) -> None:
    ks = keys(1)
    cache = caches(pages=2, host_slots=0, write_policy="write_through")
    cache.release(fill(cache, ks))
    assert not cache.host.enabled and on_disk(cache, ks) == ["k0"]
    assert same_bits(cache.disk.get(ks[0]), block_data(ks[0]))
    assert counts(cache, "disk")[2] == 1
    check(cache)


@pytest.mark.parametrize("writer,reader", [("raw", "zstd"), ("zstd", "raw"), ("nibble", "zstd"), ("raw", "nibble")])
def test_the_configured_codec_writes_the_disk_and_either_reads_it(tmp_path: Path, writer: str, reader: str) -> None:
    ks = keys(3)
    path = tmp_path / "disk"
    cache = make_cache(path, pages=4, host_slots=2, codec=writer)
    assert cache.disk.codec.kind == writer
    cache.release(fill(cache, ks))
    assert cache.flush().written == 3
    cache.close()
    env = lmdb.open(str(path), max_dbs=4, readonly=True)
    try:
        with env.begin() as txn:
            headers = [Codec().check_header(txn.get(k.hash, db=env.open_db(b"payload", txn=txn))) for k in ks]
    finally:
        env.close()
    # raw: the bytes as they are, no planes; nibble: planes, no zstd; zstd: planes in zstd frames
    assert [(h.whole, h.nibble) for h in headers] == [(writer == "raw", writer == "nibble")] * 3
    cache = make_cache(path, pages=4, host_slots=2, codec=reader)
    try:
        got = cache.load_now(cache.match(ks))
        assert got.tiers == ("disk",) * 3 and len(got.pages) == 3
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        assert cache.disk.stats().corrupt == 0
    finally:
        cache.close()


@pytest.mark.parametrize("failure", ["damaged payload", "token mismatch"])
def test_block_failing_verification_is_a_miss_at_acquire(tmp_path: Path, failure: str) -> None:
    ks = keys(3)
    path = tmp_path / "disk"
    cache = make_cache(path, pages=4, host_slots=2)
    cache.release(fill(cache, ks))
    assert cache.flush().written == 3                         # device blocks straight to disk
    assert cache.drop("device") == 3 and cache.drop("host") == 0
    cache.close()
    wanted = list(ks)
    if failure == "damaged payload":
        damage_payload(path, ks[1].hash)
    else:
        wanted[1] = dataclasses.replace(ks[1], token_ids=tuple(t + 1 for t in ks[1].token_ids))
    cache = make_cache(path, pages=4, host_slots=2)
    try:
        m = cache.match(wanted)
        assert [t for _, t in m.blocks] == ["disk"] * 3   # match reads the index, not the bytes
        got = cache.load_now(m)
        assert got.tiers == ("disk",)                 # the prefix ends at the bad block
        assert same_bits(cache.pool.kv[got.pages[0]], block_data(ks[0]))
        p = cache.pool.stats()
        # The pages after the cut went back: k1's is free, k2's (read and verified in the same
        # load) stays as a cached, evictable device block.
        assert (p.in_use_pages, p.cached_blocks, p.free_pages) == (1, 2, 2)
        d = cache.disk.stats()
        assert (d.corrupt, d.blocks) == (1, 2)
        assert not cache.disk.contains(ks[1])    # deleted
        assert counts(cache, "disk")[:2] == (1, 2)    # served k0; promoted k0 and k2
        assert tiers(cache.match(ks), ks) == [("k0", "device")]
        assert tiers(cache.match([ks[2]]), ks) == [("k2", "device")]
        cache.release(got.pages)
        check(cache)
    finally:
        cache.close()


def test_corrupt_disk_block_releases_device_pages_acquired_after_it(tmp_path: Path) -> None:
    ks = keys(3)
    path = tmp_path / "disk"
    cache = make_cache(path, pages=4, host_slots=0)
    cache.release(fill(cache, ks[:2]))
    cache.flush()
    cache.close()
    damage_payload(path, ks[1].hash)
    cache = make_cache(path, pages=4, host_slots=0)
    try:
        cache.release(fill(cache, [ks[2]]))               # k2 on the device, after the bad k1
        m = cache.match(ks)
        assert tiers(m, ks) == [("k0", "disk"), ("k1", "disk"), ("k2", "device")]
        got = cache.load_now(m)
        assert got.tiers == ("disk",)
        k2_page = cache.pool.page_of(ks[2])
        assert cache.pool.refcount(k2_page) == 0 and k2_page in cache.pool.evictable_pages()
        assert counts(cache, "device")[0] == 0        # no hit counted past the cut
        cache.release(got.pages)
        check(cache)
    finally:
        cache.close()


def test_a_flush_hands_its_copies_to_the_disk_without_copying_them_again(tmp_path: Path, monkeypatch) -> None:
    """Issue 28: the flush's thread copies each block out of its page or slot once (private_copy)
    and hands that copy to the disk (put(owned=True)); it was copied a second time inside put (a
    third of a flush thread's time in tools/bench_flush_interference.py). The bytes stored are the
    page's and the slot's."""
    from storage import cascade, lower_tier
    from storage.disk import tier as disk_tier
    made = []
    real = lower_tier.private_copy

    def counting(block):
        made.append(1)
        return real(block)
    for module in (lower_tier, cascade, disk_tier):
        monkeypatch.setattr(module, "private_copy", counting, raising=False)
    ks = keys(6)
    cache = make_cache(tmp_path / "disk", pages=4, host_slots=2)
    try:
        cache.release(fill(cache, ks[:4]))
        held = fill(cache, ks[4:6])                    # k0, k1 in the host, k2..k5 on the device
        assert cache.flush().written == 6
        assert len(made) == 6                          # one copy out per block, none in put
        cache.release(held)
        for k in ks:
            assert same_bits(cache.disk.get(k), block_data(k))
        check(cache)
    finally:
        cache.close()


def test_flush_pushes_every_block_to_disk_and_a_new_cache_finds_them(tmp_path: Path) -> None:
    ks = keys(6)
    path = tmp_path / "disk"
    cache = make_cache(path, pages=4, host_slots=2)
    cache.release(fill(cache, ks[:4]))
    held = fill(cache, ks[4:6])                        # evicts k0, k1 into the host; k4, k5 stay held
    assert on_host(cache, ks) == ["k0", "k1"] and on_device(cache, ks) == {"k2", "k3", "k4", "k5"}
    assert cache.flush().written == 6                          # held pages are flushed too
    assert sorted(on_disk(cache, ks)) == [f"k{i}" for i in range(6)]
    assert cache.flush().written == 0                          # nothing left to write
    assert counts(cache, "disk")[2] == 6
    cache.release(held)
    cache.close()

    cache = make_cache(path, pages=8, host_slots=2)
    try:
        m = cache.match(ks)
        assert [t for _, t in m.blocks] == ["disk"] * 6
        got = cache.load_now(m)
        assert got.tiers == ("disk",) * 6
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        check(cache)
    finally:
        cache.close()


def test_drop_and_demote_each_tier(caches) -> None:
    ks = keys(4)
    cache = caches(pages=4, host_slots=2)
    pages = fill(cache, ks)
    cache.release(pages[:3])
    assert cache.demote("device") == 3                 # k3 is held: it stays
    assert on_device(cache, ks) == {"k3"} and on_host(cache, ks) == ["k1", "k2"] and on_disk(cache, ks) == ["k0"]
    assert cache.drop("device") == 0                   # held pages are never dropped
    assert cache.drop("host") == 2
    assert len(cache.host) == 0 and cache.host.stats().evictions == 1   # a drop is not an eviction
    assert tiers(cache.match(ks), ks) == [("k0", "disk")]
    assert cache.drop("disk") == 1
    assert cache.match(ks).blocks == ()
    cache.release([pages[3]])
    assert cache.drop("device") == 1
    assert cache.match([ks[3]]).blocks == ()
    assert [cache.stats()[t].blocks for t in ("device", "host", "disk")] == [0, 0, 0]
    assert cache.pool.stats().free_pages == 4
    with pytest.raises(ValueError, match="tier"):
        cache.drop("gpu")
    with pytest.raises(ValueError, match="tier"):
        cache.demote("disk")
    check(cache)


def test_demote_host_moves_every_block_to_disk(caches) -> None:
    ks = keys(3)
    cache = caches(pages=3, host_slots=3)
    cache.release(fill(cache, ks))
    assert cache.demote("device") == 3 and on_host(cache, ks) == ["k0", "k1", "k2"]
    assert cache.demote("host") == 3
    assert len(cache.host) == 0 and on_disk(cache, ks) == ["k0", "k1", "k2"]
    assert counts(cache, "host") == (0, 0, 3, 3, 0)
    assert counts(cache, "disk") == (0, 0, 3, 0, 3)
    assert cache.demote("host") == 0
    got = cache.load_now(cache.match(ks))
    assert got.tiers == ("disk",) * 3
    assert all(same_bits(cache.pool.kv[p], block_data(k)) for p, k in zip(got.pages, ks))
    cache.release(got.pages)
    check(cache)


def test_stats_report_capacities_and_usage(caches) -> None:
    cache = caches(pages=3, host_slots=2)
    ks = keys(2)
    held = fill(cache, ks)
    s = cache.stats()
    assert (s["device"].capacity_bytes, s["device"].used_bytes) == (3 * TINY.nbytes, 2 * TINY.nbytes)
    assert s["device"].extra == {"pages": 3, "free_pages": 1, "in_use_pages": 2}
    assert (s["host"].capacity_bytes, s["host"].used_bytes) == (2 * TINY.nbytes, 0)
    assert s["disk"].capacity_bytes == DISK and s["disk"].extra["enabled"] is True
    cache.release(held)
    cache.demote("device")
    s = cache.stats()
    assert (s["device"].used_bytes, s["host"].used_bytes, s["host"].blocks) == (0, 2 * TINY.nbytes, 2)
    assert s["host"].to_dict()["pinned"] is False
    check(cache)


def test_audit_catches_broken_bookkeeping(caches) -> None:
    cache = caches(pages=2, host_slots=1)
    (page,) = fill(cache, keys(1))
    cache.audit()
    cache.pool._ref[page] = 0                          # a page lost: neither held, free nor evictable
    with pytest.raises(AssertionError, match="lost"):
        cache.audit()
    cache.pool._ref[page] = 1
    cache.release([page])
    cache.audit()


def test_close_waits_for_a_disk_promotion_in_progress(tmp_path: Path, monkeypatch) -> None:
    # get_many decodes straight from LMDB's map: closing the environment under it would crash.
    layout = BlockLayout(num_layers=8, block_size=4, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    ks = keys(48, layout=layout)
    config = CacheConfig(block_size=4, device_memory=len(ks) * layout.nbytes, host_memory=0,
                         disk_dir=str(tmp_path), disk_capacity=DISK)
    disk = DiskTier(str(tmp_path), DISK, layout=layout, decode_threads=1)   # decodes in the caller
    cache = TieredKVCache(layout, config, num_pages=len(ks), disk=disk)
    cache.release(fill(cache, ks))
    cache.flush()
    cache.drop("device")
    m = cache.match(ks)
    assert [t for _, t in m.blocks] == ["disk"] * len(ks)
    result: dict = {}
    decoding = threading.Event()                          # set by the first decode, inside the read
    verify_and_decode = disk._verify_and_decode
    disk._verify_and_decode = lambda *block: (decoding.set(), verify_and_decode(*block))[1]
    # A block handed to the compiled batch (every codec's, where it is built) is read there too.
    add = block_batch.BlockBatch.add
    monkeypatch.setattr(block_batch.BlockBatch, "add", lambda self, *block: (decoding.set(), add(self, *block))[1])
    promotion = threading.Thread(target=lambda: result.update(got=cache.load_now(m)))
    promotion.start()
    assert decoding.wait(30)                              # the read holds views into the map now
    cache.close()                                         # must wait for that read to end
    promotion.join()
    got = result["got"]
    assert got.tiers == ("disk",) * len(ks)
    assert all(same_bits(cache.pool.kv[p], block_data(k, layout)) for p, k in zip(got.pages, ks))
    with pytest.raises(RuntimeError, match="closed"):
        disk.get(ks[0])
