"""The remote tier against real valkey-server processes (tools/valkey_servers.py): a standalone
server and a 3-node cluster, shared per session; tests that kill a server start their own.
Each test writes under its own namespace, so tests sharing a server never see each other's keys.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import redis
import torch

from storage.codec.payload import Codec
from storage.remote.breaker import BreakerConfig
from storage.remote.tier import RemoteTier
from storage.remote.value import remote_key
from storage.remote.url import parse_remote_url
from tests.storage.conftest import fleet, TINY, block_data, keys
from tests.storage.test_tiered_cache import same_bits
from tools.valkey_servers import ValkeyServer


@pytest.fixture(params=["standalone", "cluster"])
def server(request):
    return request.getfixturevalue("valkey" if request.param == "standalone" else "valkey_cluster")


def raw_client(url: str):
    """A plain client of the store (not ours): to look at and damage what the tier wrote."""
    u = parse_remote_url(url)
    if u.cluster:
        return redis.RedisCluster(host=u.nodes[0][0], port=u.nodes[0][1])
    return redis.Redis(host=u.nodes[0][0], port=u.nodes[0][1])


def tier(url: str, **kw) -> RemoteTier:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("secret", fleet())
    return RemoteTier(parse_remote_url(url), TINY, **kw)


def test_round_trip_is_bit_identical_and_a_batched_get_serves_what_is_there(server) -> None:
    ns = os.urandom(32)
    ks = keys(40, ns=ns)
    rt = tier(server.url)
    try:
        for k in ks[:30]:
            assert rt.put(k, block_data(k))
        assert rt.drain(10)
        assert rt.probe(ks) == frozenset(k.hash for k in ks[:30])      # the chain's stored prefix
        assert rt.exists_many(ks) == [True] * 30 + [False] * 10
        outs = [torch.empty(TINY.shape, dtype=TINY.dtype) for _ in ks]
        got = rt.get_many(ks, outs)                                      # one batch: 30 hits, 10 misses
        assert [g is not None for g in got] == [True] * 30 + [False] * 10
        for g, out, k in zip(got[:30], outs, ks):
            assert same_bits(g, block_data(k)) and same_bits(out, block_data(k))
        s = rt.stats()
        assert (s.store_hits, s.misses, s.corrupt, s.errors, s.writes, s.breaker) == (30, 10, 0, 0, 30, "closed")
        assert s.bytes_written == s.bytes_read > 0
    finally:
        rt.close()


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
def test_a_damaged_value_is_a_miss_deleted_and_counted(server, kind: str) -> None:
    ns = os.urandom(32)
    ks = keys(3, ns=ns)
    rt = tier(server.url, codec=Codec(kind=kind))
    raw = raw_client(server.url)
    try:
        for k in ks:
            rt.put(k, block_data(k))
        assert rt.drain(10)
        value = bytearray(raw.get(remote_key(ks[0])))
        value[-20] ^= 0x40                                   # a bit flip in the zstd frame
        raw.set(remote_key(ks[0]), bytes(value))
        raw.set(remote_key(ks[1]), b"not a block at all")    # garbage
        got = rt.get_many(ks)
        assert got[0] is None and got[1] is None and same_bits(got[2], block_data(ks[2]))
        s = rt.stats()
        assert (s.corrupt, s.store_hits, s.misses) == (2, 1, 2)
        assert raw.exists(remote_key(ks[0])) == 0 and raw.exists(remote_key(ks[1])) == 0   # deleted
        assert raw.exists(remote_key(ks[2])) == 1
    finally:
        raw.close()
        rt.close()


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
def test_a_get_over_parallel_connections_is_bit_identical_and_a_damaged_value_is_a_miss_deleted(
        server, kind: str) -> None:
    ns = os.urandom(32)
    ks = keys(140, ns=ns)                  # 5 MGETs standalone, one per hash slot in the cluster
    rt = tier(server.url, codec=Codec(kind=kind), connections=4, timeout_s=5)
    raw = raw_client(server.url)
    try:
        for k in ks[:130]:                 # batches of 32, each sent as 4 pipelines at once
            assert rt.put(k, block_data(k))
        assert rt.drain(30) and rt.stats().writes == 130 and rt.stats().write_errors == 0
        value = bytearray(raw.get(remote_key(ks[5])))
        value[-20] ^= 0x40                                   # a bit flip: damaged
        raw.set(remote_key(ks[5]), bytes(value))
        raw.set(remote_key(ks[100]), b"not a block at all")  # garbage, in another MGET
        outs = [torch.zeros(TINY.shape, dtype=TINY.dtype) for _ in ks]
        got = rt.get_many(ks, outs)
        assert any(t.name.startswith("tieredkv-remote-fetch") for t in threading.enumerate())
        for i, (g, out, k) in enumerate(zip(got, outs, ks)):
            if i in (5, 100) or i >= 130:
                assert g is None, i
            else:
                assert same_bits(g, block_data(k)) and same_bits(out, block_data(k)), i
        s = rt.stats()
        assert (s.store_hits, s.misses, s.corrupt, s.errors) == (128, 12, 2, 0)
        assert raw.exists(remote_key(ks[5])) == 0 and raw.exists(remote_key(ks[100])) == 0   # deleted
        assert raw.exists(remote_key(ks[6])) == 1
    finally:
        raw.close()
        rt.close()


@pytest.mark.parametrize("writer,reader", [("raw", "zstd"), ("zstd", "raw"), ("nibble", "raw")])
def test_a_store_written_with_one_codec_is_served_by_a_tier_with_the_other(valkey, writer: str, reader: str) -> None:
    ks = keys(4, ns=os.urandom(32))
    w = tier(valkey.url, codec=Codec(kind=writer))
    try:
        for k in ks:
            assert w.put(k, block_data(k))
        assert w.drain(10)
    finally:
        w.close()
    r = tier(valkey.url, codec=Codec(kind=reader))
    try:
        got = r.get_many(ks)
        assert all(g is not None and same_bits(g, block_data(k)) for g, k in zip(got, ks))
        assert r.stats().corrupt == 0
    finally:
        r.close()


def test_tenants_are_isolated_even_when_bytes_land_under_another_tenants_key(valkey) -> None:
    ns_a, ns_b = os.urandom(32), os.urandom(32)
    tokens_a = keys(2, ns=ns_a)
    tokens_b = keys(2, ns=ns_b)                         # the same tokens, another tenant
    rt = tier(valkey.url)
    raw = raw_client(valkey.url)
    try:
        for k in tokens_a:
            rt.put(k, block_data(k))
        assert rt.drain(10)
        assert remote_key(tokens_a[0]) != remote_key(tokens_b[0])
        assert rt.get_many(tokens_b) == [None, None]        # B's keys hold nothing
        # A's bytes copied under B's key (a misplaced value): the binding refuses them.
        raw.set(remote_key(tokens_b[0]), raw.get(remote_key(tokens_a[0])))
        assert rt.get(tokens_b[0]) is None
        assert rt.stats().corrupt == 1 and raw.exists(remote_key(tokens_b[0])) == 0
        assert same_bits(rt.get(tokens_a[0]), block_data(tokens_a[0]))
    finally:
        raw.close()
        rt.close()


def test_a_ttl_is_set_on_every_write(server) -> None:
    ks = keys(4, ns=os.urandom(32))
    rt = tier(server.url, ttl_s=30)
    raw = raw_client(server.url)
    try:
        for k in ks:
            rt.put(k, block_data(k))
        assert rt.drain(10)
        ttls = [raw.pttl(remote_key(k)) for k in ks]
        assert all(25_000 < t <= 30_000 for t in ttls), ttls
    finally:
        raw.close()
        rt.close()


def test_a_password_protected_server_and_a_wrong_password(tmp_path) -> None:
    server = ValkeyServer("--requirepass", "s3cret")
    try:
        server.start()
        k = keys(1, ns=os.urandom(32))[0]
        good = tier(f"valkey://:s3cret@127.0.0.1:{server.port}")
        bad = tier(f"valkey://:wrong@127.0.0.1:{server.port}")
        try:
            assert "s3cret" not in good.stats().url and "***" in good.stats().url
            good.put(k, block_data(k))
            assert good.drain(10)
            assert same_bits(good.get(k), block_data(k))
            assert bad.get(k) is None                     # refused: a miss, never an exception
            assert bad.stats().errors == 1 and "s3cret" not in (bad.stats().last_error or "")
        finally:
            good.close()
            bad.close()
    finally:
        server.cleanup()


def test_a_full_store_refuses_writes_without_failing_or_opening_the_breaker() -> None:
    server = ValkeyServer("--maxmemory-policy", "noeviction", maxmemory="2mb")
    try:
        server.start()
        rt = tier(server.url)
        try:
            ks = keys(2000, ns=os.urandom(32))       # ~2.3 MiB of values, past the 2 MiB bound
            for k in ks:
                rt.put(k, block_data(k), wait=True, timeout=10)
            assert rt.drain(30) is False              # some writes were refused
            s = rt.stats()
            assert s.write_errors > 0 and s.writes > 0 and s.breaker == "closed" and s.errors == 0
            assert "OutOfMemory" in (s.last_error or "") or "OOM" in (s.last_error or "")
        finally:
            rt.close()
    finally:
        server.cleanup()


def test_a_server_down_opens_the_breaker_without_an_exception_and_a_restart_closes_it() -> None:
    server = ValkeyServer()
    try:
        server.start()
        ks = keys(3, ns=os.urandom(32))
        # A stopped server refuses connections at once, so the timeout is never waited for: a
        # generous one only keeps a loaded machine's slow answer from counting as an outage.
        rt = tier(server.url, timeout_s=10, breaker=BreakerConfig(failures_to_open=3, cooldown_s=0.3))
        # The breaker's clock is the test's: the cooldown passes when the test says, never because
        # a loaded machine took 0.3 s between two calls (that made the "open" calls probes).
        now = [0.0]
        rt.breaker._clock = lambda: now[0]
        try:
            for k in ks:
                rt.put(k, block_data(k))
            assert rt.drain(60) and rt.get(ks[0]) is not None
            server.stop()
            for _ in range(3):                        # three failures in a row: open
                assert rt.get_many(ks) == [None] * 3
            assert rt.breaker.state == "open" and rt.stats().errors == 3
            assert rt.get_many(ks) == [None] * 3 and rt.exists_many(ks) == [False] * 3
            # Open: both calls answered by the breaker, nothing sent (no error counted, no wait
            # for a timeout) -- counted, not timed: a loaded machine makes any time bound flaky.
            assert rt.stats().skipped == 2 and rt.stats().errors == 3
            extra = keys(4, ns=os.urandom(32))[3]
            # The mark before the put: the writer may drop the batch before drain() starts waiting.
            mark = rt.write_failures()
            assert rt.put(extra, block_data(extra))   # queued, then dropped by the open breaker
            assert rt.drain(60, since=mark) is False and rt.stats().write_drops == 1
            assert rt.breaker.state == "open" and rt.stats().errors == 3
            server.start()                            # back, on the same port, empty
            now[0] += 0.3                             # the cooldown: the next call is a probe
            assert rt.breaker.state == "half_open"
            assert rt.get(ks[0]) is None              # a miss (the store restarted empty)...
            assert rt.breaker.state == "closed"       # ...but it answered: closed again
            rt.put(ks[0], block_data(ks[0]))          # written again (the "known" set was forgotten)
            assert rt.drain(60) and same_bits(rt.get(ks[0]), block_data(ks[0]))
        finally:
            rt.close()
    finally:
        server.cleanup()


def accept_all(listener) -> int:
    """How many connections a hung store's listener holds (each accepted, then closed)."""
    listener.settimeout(0)
    accepted = []
    with contextlib.suppress(BlockingIOError):
        while True:
            accepted.append(listener.accept()[0])
    for conn in accepted:
        conn.close()
    return len(accepted)


def test_a_store_that_never_answers_costs_one_timeout_per_connection_and_one_breaker_failure() -> None:
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)               # accepts connections, never answers: a hung store
    try:
        ks = keys(320, ns=os.urandom(32))          # 10 MGETs, 4 connections
        rt = tier(f"valkey://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.2, connections=4,
                  breaker=BreakerConfig(failures_to_open=2, cooldown_s=60))
        try:
            assert rt.get_many(ks) == [None] * len(ks)
            # The MGETs in flight when the first timed out were the only ones sent (none started
            # after it, none retried): at most one connection per thread, not one per MGET.
            accepted = accept_all(listener)
            assert 1 <= accepted <= 4
            s = rt.stats()
            assert (s.errors, s.misses, s.breaker) == (1, len(ks), "closed")   # one call, one failure
        finally:
            rt.close(timeout=1)
    finally:
        listener.close()


def test_a_store_that_never_answers_costs_at_most_its_timeout(tmp_path) -> None:
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)               # accepts connections, never answers: a hung store
    try:
        port = listener.getsockname()[1]
        ks = keys(2, ns=os.urandom(32))
        rt = tier(f"valkey://127.0.0.1:{port}", timeout_s=0.2, breaker=BreakerConfig(failures_to_open=2, cooldown_s=60))
        try:
            t0 = time.monotonic()
            assert rt.get_many(ks) == [None, None]
            # One timeout, no retry: a retry would reconnect (redis-py drops a timed-out
            # connection), so the hung store saw exactly one connection -- counted, not timed
            # (a loaded machine can stretch one 0.2 s timeout past any tight bound). The bound
            # only says it was bounded (no timeout at all would hang here forever).
            assert time.monotonic() - t0 < 30
            accepted = accept_all(listener)
            assert accepted == 1
            assert rt.get_many(ks) == [None, None]
            assert rt.breaker.state == "open"
            skipped = rt.stats().skipped
            assert rt.probe(ks) == frozenset()
            assert rt.stats().skipped == skipped + 1 and rt.stats().errors == 2   # answered by the breaker
        finally:
            rt.close(timeout=1)
    finally:
        listener.close()
