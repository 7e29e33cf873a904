"""Issue 18, item 3: the loader's copies overlap everything else (storage/loader.py).

Host fills hold the tiers' lock only for bookkeeping: while a fill waits for the copy into a
slot, or copies slots into its pages, another thread takes the lock, and a slot being read is
never evicted or reused (HostTier.pin). Staged fills (stage_decodes on the CPU) are
double-buffered: part k+1 is read into one staging half while part k's copies out of the other
run, and a half is rewritten only once its copies are complete. Copies are held or made late
with events on real fills (Loader.defer_copies, Transfer(deferred=True)): the assertions are
orders and counts, never timings. Real LMDB and zstd under tmp_path.
"""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from storage import loader as loader_module
from storage import transfer as transfer_module
from storage.config import CacheConfig
from storage.disk.tier import DiskTier
from storage.tiered_cache import TieredKVCache
from storage.transfer import Transfer
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_loader import disk_only, held_reads  # noqa: F401 (a fixture)
from tests.storage.test_tiered_cache import fill, same_bits


def cache_with(path: Path, pages: int, host_slots: int, deferred: bool = False) -> TieredKVCache:
    config = CacheConfig(block_size=TINY.block_size, device_memory=pages * TINY.nbytes,
                         host_memory=host_slots * TINY.nbytes, disk_dir=str(path), disk_capacity=64 << 20)
    return TieredKVCache(TINY, config, num_pages=pages,
                         transfer=Transfer(torch.device("cpu"), deferred=deferred))


def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.fixture
def held_fill_copies(monkeypatch):
    """The loader's deferred copies into pages wait for `gate`; `started` is set when one is
    waiting. Returns (gate, started)."""
    gate, started = threading.Event(), threading.Event()
    real = loader_module._late_copy

    def held(copies):
        started.set()
        assert gate.wait(10), "the test never let the copy go"
        real(copies)
    monkeypatch.setattr(loader_module, "_late_copy", held)
    yield gate, started
    gate.set()


def slots_of(cache: TieredKVCache, ks) -> list[int]:
    with cache.tiers.lock:
        return [cache.host.slot_of(k) for k in ks]


# ---- host fills ------------------------------------------------------------------------------
def test_a_host_fill_copies_with_the_lock_free_and_its_slots_are_never_reused(tmp_path, held_fill_copies) -> None:
    gate, copying = held_fill_copies
    cache = cache_with(tmp_path / "disk", pages=6, host_slots=4)
    try:
        ks = keys(3)
        cache.release(fill(cache, ks))
        cache.demote("device")                      # k0..k2 now only in the host slots
        slots = slots_of(cache, ks)
        cache.loader.defer_copies()
        load = cache.start_load(cache.match(ks))
        assert load.tiers == ["host"] * 3
        assert copying.wait(10)                     # the fill's copies out of the slots are running
        # Another thread takes the tiers' lock mid-copy (the old fill held it until its copies
        # were complete), sees the slots pinned, and puts the host tier under pressure: three new
        # blocks through a 4-slot slab with 3 pinned slots (the LRU ones: k0, k1, k2, then the
        # new blocks) must take turns in the one free slot.
        got_lock: list[bool] = []
        seen: list[tuple] = []

        def engine_step() -> None:
            got_lock.append(cache.tiers.lock.acquire(timeout=5))
            if not got_lock[-1]:
                return
            try:
                seen.append((tuple(cache.host.readers(s) for s in slots), cache.host.reservable()))
            finally:
                cache.tiers.lock.release()
            cache.release(fill(cache, keys(3, start_token=1000)))
            cache.demote("device")
            seen.append(("pressed",))
        t = threading.Thread(target=engine_step)
        t.start()
        t.join(30)
        assert got_lock == [True], "the host fill held the tiers' lock across its copies"
        assert seen == [((1, 1, 1), 1), ("pressed",)]
        assert cache.host.stats().evictions == 2            # the new blocks, never a pinned one
        assert not load.ready()
        assert slots_of(cache, ks) == slots                # no pinned slot was evicted
        for s, k in zip(slots, ks):                        # ...or rewritten
            assert same_bits(cache.host.slab[s], block_data(k))
        gate.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("host",) * 3
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        assert [cache.host.readers(s) for s in slots] == [0, 0, 0]
        cache.release(got.pages)
        cache.audit()
    finally:
        gate.set()
        cache.close()


def test_a_host_fill_waits_for_the_copy_into_its_slot_with_the_lock_free(tmp_path, monkeypatch) -> None:
    """The copy into the slot (device -> host, deferred) is still queued when the fill plans: the
    fill waits for it holding no lock, then reads the slot's complete bytes."""
    gate = threading.Event()
    real = transfer_module._late_copy
    monkeypatch.setattr(transfer_module, "_late_copy", lambda copies: (gate.wait(10), real(copies))[1])
    cache = cache_with(tmp_path / "disk", pages=6, host_slots=4, deferred=True)
    try:
        ks = keys(2)
        cache.release(fill(cache, ks))
        cache.demote("device")                      # the copies into the slots are held
        slots = slots_of(cache, ks)
        load = cache.start_load(cache.match(ks))
        assert load.tiers == ["host"] * 2

        def pinned() -> bool:
            with cache.tiers.lock:
                return all(cache.host.readers(s) == 1 for s in slots)
        until(pinned, "the fill to pin its slots")
        # The fill now waits for the held copies into its slots: the lock is free meanwhile.
        got_lock: list[bool] = []
        t = threading.Thread(target=lambda: (got_lock.append(cache.tiers.lock.acquire(timeout=5)),
                                             cache.tiers.lock.release() if got_lock[-1] else None))
        t.start()
        t.join(10)
        assert got_lock == [True], "the host fill held the tiers' lock across its wait"
        assert not load.ready()
        gate.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("host",) * 2
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        cache.audit()
    finally:
        gate.set()
        cache.close()


def test_host_fills_under_pressure_from_a_tiny_host_tier_are_exact(tmp_path) -> None:
    """Every copy late (into host slots and out of them into pages), 3 host slots, 5 pages:
    requests load prefixes of one chain while new blocks are computed beside them, pushing
    device -> host -> disk on every allocation. Every page a load gives is bit-identical."""
    rng = random.Random(18)
    cache = cache_with(tmp_path / "disk", pages=5, host_slots=3, deferred=True)
    cache.loader.defer_copies()
    try:
        chain = keys(4)
        cache.release(fill(cache, chain))
        for r in range(40):
            want = chain[:rng.randint(1, len(chain))]
            load = cache.start_load(cache.match(want))
            for k in keys(1, start_token=10_000 + 4 * r):     # a new block computed meanwhile
                if cache.can_allocate(1):
                    cache.release(fill(cache, [k]))
            if rng.random() < 0.5:
                cache.demote("device")
            assert load.wait(10)
            got = cache.finish_load(load)
            for page, k in zip(got.pages, want):
                assert same_bits(cache.pool.kv[page], block_data(k)), f"round {r}: a page holds wrong bytes"
            cache.release(got.pages)
            cache.audit()
        assert cache.stats()["host"].promotions > 0
    finally:
        cache.close()


# ---- staged fills ----------------------------------------------------------------------------
@pytest.fixture
def staged(monkeypatch):
    """Staged fills on the CPU in parts of 3 blocks."""
    monkeypatch.setattr(loader_module, "STAGE_BLOCKS", 3)


def test_staged_fills_of_many_parts_are_exact_with_late_copies(tmp_path, staged) -> None:
    cache, ks = disk_only(tmp_path, 11, pages=12)     # 4 parts: each half is reused
    try:
        cache.loader.stage_decodes = True
        cache.loader.defer_copies()
        got = cache.load_now(cache.match(ks))
        assert got.tiers == ("disk",) * 11
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        cache.audit()
    finally:
        cache.close()


@pytest.mark.parametrize("missing", [2, 3, 7, 10])   # last of part 0, first of part 1, mid part 2, the end
def test_a_miss_in_one_staged_part_cuts_the_prefix_there(tmp_path, staged, held_reads, missing) -> None:
    cache, ks = disk_only(tmp_path, 11, pages=12)
    try:
        cache.loader.stage_decodes = True
        cache.loader.defer_copies()
        load = cache.start_load(cache.match(ks))
        assert cache.disk.delete(ks[missing])     # gone between plan and read
        held_reads.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) * missing
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        for k in ks[missing + 1:]:                       # filled, then cached past the cut
            page = cache.pool.page_of(k)
            assert page is not None and same_bits(cache.pool.kv[page], block_data(k))
        assert cache.pool.page_of(ks[missing]) is None
        cache.release(got.pages)
        cache.audit()
    finally:
        held_reads.set()
        cache.close()


def test_a_staging_half_is_rewritten_only_after_its_copies_and_reads_overlap_copies(
        tmp_path, staged, monkeypatch, held_fill_copies) -> None:
    gate, _ = held_fill_copies
    cache, ks = disk_only(tmp_path, 11, pages=12)
    log: list[tuple[str, int]] = []                  # ("read", part) / ("copied", part), in order
    log_lock = threading.Lock()
    real_get, real_copy = DiskTier.get_many, loader_module._late_copy

    def get_many(tier, keys, outs=None):
        with log_lock:
            log.append(("read", sum(1 for e, _ in log if e == "read")))
        return real_get(tier, keys, outs)

    def copy(copies):
        real_copy(copies)                              # the held one: waits for the gate
        with log_lock:
            log.append(("copied", sum(1 for e, _ in log if e == "copied")))
    monkeypatch.setattr(DiskTier, "get_many", get_many)
    monkeypatch.setattr(loader_module, "_late_copy", copy)
    waiting = threading.Event()
    real_wait = cache.loader._wait_copies

    def wait_copies(done):
        if done is not None and not done.done():
            waiting.set()
        real_wait(done)
    cache.loader._wait_copies = wait_copies
    try:
        cache.loader.stage_decodes = True
        cache.loader.defer_copies()
        load = cache.start_load(cache.match(ks))
        # Part 0's copies are held: part 1 is read into the other half meanwhile, and part 2
        # waits for half 0's copies instead of reading into it.
        until(lambda: waiting.is_set() or len(log) > 2, "the fill to wait for half 0")
        with log_lock:
            assert log == [("read", 0), ("read", 1)], log
        assert not load.ready()
        gate.set()
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("disk",) * 11
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        order = {e: i for i, e in enumerate(log)}
        assert len(order) == 8                           # 4 parts read, 4 copied
        for k in range(2, 4):                            # half k % 2 rewritten after part k-2's copies
            assert order[("copied", k - 2)] < order[("read", k)], log
        assert order[("read", 1)] < order[("copied", 0)], log    # the overlap
        cache.release(got.pages)
        cache.audit()
    finally:
        gate.set()
        cache.close()


def test_the_stage_part_is_independent_of_the_remote_mget_chunk() -> None:
    from storage.remote.client import MGET_CHUNK
    assert loader_module.STAGE_BLOCKS >= 2 * MGET_CHUNK    # a remote part spans MGETs that overlap decode
