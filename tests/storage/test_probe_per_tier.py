"""Each tier over a link answers its own probe (issue 43, item 2): with two linked tiers, a block
only the second holds is matched, planned and read from the second, never credited to the first
(whose fill would then miss). Two real valkey-server stores (tools/valkey_servers.py)."""
from __future__ import annotations

import os

import pytest

from storage.codec.payload import Codec
from storage.config import CacheConfig
from storage.remote.tier import RemoteTier
from storage.tiered_cache import TieredKVCache
from tests.storage.conftest import TINY, block_data, fleet, keys
from tests.storage.test_tiered_cache import same_bits


@pytest.fixture
def second_store():
    from tools.valkey_servers import ValkeyServer
    server = ValkeyServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


def _store(url: str, name: str | None = None) -> RemoteTier:
    from storage.remote.url import parse_remote_url
    tier = RemoteTier(parse_remote_url(url), TINY, Codec(kind="raw"), secret=fleet())
    if name is not None:
        tier.name = name        # a second store of its own name (as an object store would be)
    return tier


def test_a_block_only_the_second_linked_tier_holds_is_read_from_it(valkey, second_store) -> None:
    ks = keys(4, ns=os.urandom(32))
    first, second = _store(valkey.url), _store(second_store.url, name="store2")
    for k in ks:
        assert second.put(k, block_data(k), wait=True)
    assert second.drain(10)
    config = CacheConfig(block_size=TINY.block_size, device_memory=16 * TINY.nbytes,
                         host_memory=8 * TINY.nbytes, disk_dir=None)
    cache = TieredKVCache(TINY, config, num_pages=16, disk=first, remote=second)
    try:
        assert [t.name for t in cache.tiers.linked] == ["remote", "store2"]
        # Asked now (lookup) and asked at submit (prefetch's probe, match at admission): each
        # block is the second store's, as its own probe said.
        assert [t for _, t in cache.lookup(ks).blocks] == ["store2"] * 4
        probe = cache.probe(ks)
        assert probe is not None and probe.wait(10)
        load = cache.start_load(cache.match(ks, probed=probe.answer))
        assert load.wait(10)
        got = cache.finish_load(load)
        assert got.tiers == ("store2",) * 4        # filled from the tier that holds them
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        assert cache.loader.failed_fills == 0
    finally:
        cache.close()
