"""A remote read nobody waits for any more is cut off (storage/cancellation.py): a real
valkey-server behind tools/throttle_proxy.py (a 100 Mbit/s link), blocks of 1 MiB so a read's
reply is many times what the link and its buffers hold.

What a user relies on: once a load is abandoned (its deadline passed) and no other request waits
for its fills, the store stops sending it (counted by the store itself: INFO's
total_net_output_bytes), its connection is dropped, never pooled half-read (the next command on
the pool gets its own answer, through the same link), no wrong byte lands anywhere (a block
either arrived whole and is bit-identical, or is a miss), the breaker is not blamed for the
cancel itself, and it is counted. Counters and events, no clock: the only deadlines are hang guards.
"""
from __future__ import annotations

import os
import threading
import time

import redis
import torch

from storage.cancellation import Cancellation
from storage.codec.payload import Codec
from storage.layout import BlockLayout
from storage.remote.breaker import HALF_OPEN, BreakerConfig, CircuitBreaker
from storage.remote.tier import RemoteTier
from storage.remote.url import parse_remote_url
from tests.storage.conftest import fleet, block_data, keys
from tests.storage.test_remote_cache import remote_cache
from tests.storage.test_tiered_cache import same_bits
from tools.throttle_proxy import ThrottleProxy
from tools.valkey_servers import ValkeyServer

BIG = BlockLayout(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.float32)   # 1 MiB
MiB = 1 << 20


def until(cond, what: str, deadline_s: float = 120.0) -> None:
    """A hang guard, not a timing: wait for `cond` (a busy CI machine may take its time)."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def stored(server: ValkeyServer, n: int):
    """n blocks of 1 MiB written straight into the store (no link), and their keys."""
    ks = keys(n, layout=BIG, ns=os.urandom(32))
    w = RemoteTier(parse_remote_url(server.url), BIG, Codec(kind="raw"), secret=fleet(), timeout_s=10)
    try:
        for k in ks:
            assert w.put(k, block_data(k, BIG), wait=True, timeout=60)
        assert w.drain(timeout=120)
    finally:
        w.close()
    return ks


def sent_by(server: ValkeyServer) -> int:
    return redis.Redis(port=server.port).info("stats")["total_net_output_bytes"]


def test_a_cancelled_get_stops_the_store_sending_drops_its_connection_and_the_pool_answers_right() -> None:
    server = ValkeyServer(maxmemory="512mb").start()
    try:
        ks = stored(server, 96)                          # 3 MGETs of 32 MiB
        with ThrottleProxy("127.0.0.1", server.port, mbit=100) as proxy:
            rt = RemoteTier(parse_remote_url(proxy.url), BIG, Codec(kind="raw"), secret=fleet(), timeout_s=10,
                            connections=1)
            try:
                cancel = Cancellation()
                before = sent_by(server)
                got: dict = {}
                reader = threading.Thread(target=lambda: got.setdefault("blocks", rt.get_many(ks, cancel=cancel)))
                reader.start()
                until(lambda: cancel.reading > 0, "the first MGET on the wire")
                assert cancel.cancel() == 1                 # its socket shut down under the reader
                reader.join(120)
                assert not reader.is_alive()
                # The store stopped: far less than the first MGET's 32 MiB left it (0.5 MiB here; read
                # to its end, 32 MiB and no further MGET sent: the bound tells the two apart).
                assert sent_by(server) - before < 8 * MiB
                assert all(b is None or same_bits(b, block_data(k, BIG)) for b, k in zip(got["blocks"], ks))
                s = rt.stats()
                assert (s.cancelled, s.cancelled_connections, s.errors, s.breaker) == (1, 1, 0, "closed")
                # The pool's one connection was dropped, not given back half-read: the next commands
                # on it (through the same link) get their own answers, bit-identical.
                assert rt.exists_many(ks[:8]) == [True] * 8
                again = rt.get_many(ks[:3])
                assert all(same_bits(b, block_data(k, BIG)) for b, k in zip(again, ks[:3]))
                s = rt.stats()
                assert (s.errors, s.corrupt, s.cancelled) == (0, 0, 1)
            finally:
                rt.close(timeout=5)
    finally:
        server.cleanup()


def test_a_read_cancelled_before_it_is_sent_sends_nothing_and_keeps_its_connection(valkey) -> None:
    rt = RemoteTier(parse_remote_url(valkey.url), BIG, Codec(kind="raw"), secret=fleet(), timeout_s=10, connections=1)
    try:
        cancel = Cancellation()
        cancel.cancel()
        ks = keys(2, layout=BIG, ns=os.urandom(32))
        assert rt.get_many(ks, cancel=cancel) == [None, None]
        s = rt.stats()
        assert (s.cancelled, s.cancelled_connections, s.errors) == (1, 0, 0)
        assert rt.exists_many(ks) == [False, False]     # the pool answers
    finally:
        rt.close(timeout=5)


def test_a_cancel_frees_a_half_open_breakers_probe_slot_without_a_verdict() -> None:
    now = [0.0]
    b = CircuitBreaker(BreakerConfig(failures_to_open=1, cooldown_s=1), clock=lambda: now[0])
    b.failure()
    now[0] = 2.0
    assert b.allow() and not b.allow()                  # the probe slot is taken
    b.release()                                         # that probe was cancelled by its caller
    assert b.state == HALF_OPEN and b.allow()           # no verdict; the next caller may probe
    b.success()
    assert b.state == "closed"


def test_an_abandoned_load_cuts_its_read_only_when_no_request_waits_and_a_new_load_gets_every_block(tmp_path) -> None:
    server = ValkeyServer(maxmemory="512mb").start()
    try:
        ks = stored(server, 64)
        with ThrottleProxy("127.0.0.1", server.port, mbit=100) as proxy:
            c = remote_cache(None, proxy.url, pages=72, host_slots=4, layout=BIG, remote_timeout_s=10)
            try:
                probe = c.probe(ks)
                until(lambda: probe.wait(0), "the probe")
                match = c.match(ks, probed=probe.answer)
                assert len(match) == 64
                first, second = c.start_load(match), c.start_load(match)     # the second request shares the fills
                task = first.fills[0].task
                assert task is not None and all(f.task is task for f in first.fills + second.fills)
                until(lambda: task.cancel.reading > 0, "the first MGET on the wire")
                before = sent_by(server)

                kept = c.finish_load(first, abandon=True)
                assert not task.cancel.cancelled              # the second request still waits for it
                assert c.stats()["remote"].reads_cancelled == 0
                c.release(kept.pages)

                kept = c.finish_load(second, abandon=True)
                assert task.cancel.cancelled
                c.release(kept.pages)
                until(lambda: all(f.done.is_set() for f in second.fills), "the fills to end")
                # The reply on the wire stopped (2 MiB here; read to its end, 25-32 MiB).
                assert sent_by(server) - before < 8 * MiB
                st = c.stats()["remote"]
                assert (st.reads_cancelled, st.abandoned_loads, st.extra["cancelled"],
                        st.extra["cancelled_connections"]) == (1, 2, 1, 1)
                # What arrived whole before the cut landed and is right; the rest is not in the pool.
                for f in second.fills:
                    on_device = c.pool.page_of(f.key)
                    assert (on_device is not None) == f.ok
                    if f.ok:
                        assert same_bits(c.pool.kv[on_device], block_data(f.key, BIG))

                # A new request plans new fills (never the given-up ones) and gets every block.
                probe = c.probe(ks[:4])
                until(lambda: probe is None or probe.wait(0), "the probe after the cancel")
                probed = None if probe is None else probe.answer
                assert probed is None or len(c.match(ks[:4], probed=probed)) == 4
                load = c.start_load(c.match(ks[:4], probed=probed))
                assert all(f is None or not f.given_up for f in load.fills)
                until(load.ready, "the new load")
                got = c.finish_load(load)
                assert len(got.pages) == 4
                for page, k in zip(got.pages, ks):
                    assert same_bits(c.pool.kv[page], block_data(k, BIG))
                c.release(got.pages)
            finally:
                c.close()
    finally:
        server.cleanup()
