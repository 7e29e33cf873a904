"""TieredKVCache with a remote tier: what one cache computed is a remote hit for another (its own
disk and host), restored bit-identical through the loader and kept on the local disk; the
write-behind (write_back / write_through, with and without a disk tier); a dead store costs
nothing but misses. Real valkey-server processes (tools/valkey_servers.py)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from storage.config import CacheConfig
from storage.hit_account import HitAccount
from storage.layout import BlockLayout
from storage.remote.value import open_value, remote_key
from storage.tiered_cache import TieredKVCache
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_remote_tier import raw_client
from tests.storage.test_tiered_cache import fill, same_bits


def remote_cache(path: Path | None, url: str, pages: int = 16, host_slots: int = 8,
                 layout: BlockLayout = TINY, **kw) -> TieredKVCache:
    config = CacheConfig(block_size=layout.block_size, device_memory=pages * layout.nbytes,
                         host_memory=host_slots * layout.nbytes, disk_dir=None if path is None else str(path),
                         disk_capacity=1 << 24, remote_url=url, **kw)
    return TieredKVCache(layout, config, num_pages=pages)


@pytest.fixture
def caches():
    made: list[TieredKVCache] = []

    def make(*a, **kw) -> TieredKVCache:
        made.append(remote_cache(*a, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def restore(cache: TieredKVCache, ks):
    """What the engine does: prefetch and probe (the tiers over a link) at submit, match and plan
    at admission."""
    hits = HitAccount()
    pre, probe = cache.prefetch(ks, hits), cache.probe(ks)
    assert pre.wait(10) and (probe is None or probe.wait(10))
    load = cache.start_load(cache.match(ks, probed=probe.answer if probe else None), hits)
    assert load.wait(10)
    return cache.finish_load(load)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_block_computed_by_one_cache_is_a_remote_hit_for_another(tmp_path, caches, where, request) -> None:
    url = request.getfixturevalue("valkey" if where == "standalone" else "valkey_cluster").url
    ks = keys(6, ns=os.urandom(32))
    a = caches(tmp_path / "a", url)
    a.release(fill(a, ks))
    r = a.flush(10)
    assert r.complete and r.remote is True        # the disk commits were forwarded and sent
    assert a.stats()["remote"].demotions == 6

    b = caches(tmp_path / "b", url)               # its own disk and host: nothing local
    assert b.match(ks).blocks == ()
    assert b.lookup(ks).tokens_by_tier(TINY.block_size)["remote"] == 6 * TINY.block_size
    got = restore(b, ks)
    assert got.tiers == ("remote",) * 6
    for page, k in zip(got.pages, ks):
        assert same_bits(b.pool.kv[page], block_data(k))
    b.release(got.pages)
    st = b.stats()["remote"]
    assert (st.hits, st.promotions, st.extra["corrupt"], st.extra["errors"]) == (6, 6, 0, 0)
    # Kept locally: the disk has them once its writer committed them, stored as the very payloads
    # the store gave (no second compression); the host gets them when they leave the device.
    assert b.disk.drain(10) and all(b.disk.contains(k) for k in ks)
    raw = raw_client(url)
    with b.disk._env.begin() as txn:
        assert all(txn.get(k.hash, db=b.disk._payload) == bytes(open_value(remote_key(k), raw.get(remote_key(k)), b.remote.secret).payload)
                   for k in ks)
    assert b.flush(10).complete
    b.drop("device")
    b.drop("host")
    assert [t for _, t in b.match(ks).blocks] == ["disk"] * 6
    assert b.stats()["remote"].demotions == 0     # nothing was written back to the store it came from
    b.audit()


def test_staged_remote_fills_double_buffer_across_mgets_and_keep_exact_payloads(tmp_path, caches, valkey,
                                                                               monkeypatch) -> None:
    """The GPU path on the CPU (issue 18): parts of 3 blocks in two staging halves, each part two
    MGETs of at most 2 keys (the store's read of one overlapping the decode of the other), copies
    into the pages late; 8 blocks are 3 parts, so a half is reused."""
    monkeypatch.setattr("storage.loader.STAGE_BLOCKS", 3)
    monkeypatch.setattr("storage.remote.client.MGET_CHUNK", 2)
    ks = keys(8, ns=os.urandom(32))
    a = caches(tmp_path / "a", valkey.url)
    a.release(fill(a, ks))
    assert a.flush(10).remote is True
    b = caches(tmp_path / "b", valkey.url)
    b.loader.stage_decodes = True
    b.loader.defer_copies()
    got = restore(b, ks)
    assert got.tiers == ("remote",) * 8
    for page, k in zip(got.pages, ks):
        assert same_bits(b.pool.kv[page], block_data(k))
    b.release(got.pages)
    assert b.disk.drain(10) and all(b.disk.contains(k) for k in ks)    # kept from the staging halves
    raw = raw_client(valkey.url)
    with b.disk._env.begin() as txn:
        assert all(txn.get(k.hash, db=b.disk._payload) == bytes(open_value(remote_key(k), raw.get(remote_key(k)), b.remote.secret).payload)
                   for k in ks)
    b.audit()


def test_without_a_disk_tier_blocks_falling_out_of_host_and_a_flush_reach_the_remote(caches, valkey) -> None:
    ks = keys(12, ns=os.urandom(32))
    a = caches(None, valkey.url, pages=4, host_slots=4)
    for k in ks:                                  # 12 blocks through 4 pages and 4 slots: a cascade
        a.release(fill(a, [k]))
    assert a.remote.drain(10)
    assert a.stats()["remote"].demotions == 4     # the 4 that fell out of the host tier
    r = a.flush(10)
    assert r.remote is True and a.stats()["remote"].demotions == 12
    b = caches(None, valkey.url, pages=16, host_slots=0)
    got = restore(b, ks)
    assert got.tiers == ("remote",) * 12
    assert all(same_bits(b.pool.kv[p], block_data(k)) for p, k in zip(got.pages, ks))
    b.release(got.pages)


def test_write_through_sends_each_block_when_it_is_computed(tmp_path, caches, valkey) -> None:
    ks = keys(5, ns=os.urandom(32))
    a = caches(tmp_path / "a", valkey.url, remote_write="write_through")
    a.release(fill(a, ks))                        # no eviction, no flush
    assert a.cascade.writeback.wait_idle(30)      # written down behind the engine (host_writeback.py)
    assert a.disk.drain(10) and a.remote.drain(10)
    assert a.stats()["remote"].demotions == 5
    b = caches(tmp_path / "b", valkey.url)
    got = restore(b, ks)
    assert got.tiers == ("remote",) * 5
    b.release(got.pages)


def test_a_partial_remote_chain_is_a_prefix_and_the_local_part_comes_first(tmp_path, caches, valkey) -> None:
    ks = keys(6, ns=os.urandom(32))
    a = caches(tmp_path / "a", valkey.url)
    a.release(fill(a, ks[:4]))
    assert a.flush(10).remote
    b = caches(tmp_path / "b", valkey.url)
    b.release(fill(b, ks[:1]))                    # b has block 0 on its device already
    got = restore(b, ks)
    assert got.tiers == ("device", "remote", "remote", "remote")   # block 4 is nowhere: the prefix ends
    b.release(got.pages)


def test_a_dead_store_costs_misses_only(tmp_path, caches) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                 # nothing listens here
    ks = keys(4, ns=os.urandom(32))
    c = caches(tmp_path / "c", f"valkey://127.0.0.1:{port}", remote_timeout_s=0.2)
    got = restore(c, ks)                          # the probe fails: no remote block, no exception
    assert got.tiers == ()
    c.release(fill(c, ks))
    r = c.flush(10)
    assert r.complete and r.remote is False       # the disk has everything; the store got nothing
    st = c.stats()["remote"]
    assert st.extra["errors"] >= 1 and st.extra["enabled"] is True and st.hits == 0
    assert c.lookup(ks).tokens_by_tier(TINY.block_size)["device"] == 4 * TINY.block_size


def test_status_names_the_store_without_its_password(tmp_path, caches, valkey) -> None:
    url = valkey.url.replace("valkey://", "valkey://someone:hunter2@")
    c = caches(tmp_path / "c", url, remote_timeout_s=0.2)
    extra = c.stats()["remote"].to_dict()
    assert extra["enabled"] is True and extra["url"] == url.replace("hunter2", "***")
    for key in ("breaker", "misses", "errors", "corrupt", "writes", "store_hits", "bytes_read", "bytes_written",
                "write_policy"):
        assert key in extra, key
    assert "hunter2" not in repr(c.config) and "hunter2" not in str(extra)
    plain = TieredKVCache(TINY, CacheConfig(block_size=TINY.block_size, device_memory=4 * TINY.nbytes, host_memory=0,
                                            disk_dir=None), num_pages=4)
    assert plain.stats()["remote"].to_dict()["enabled"] is False
    plain.close()
