"""Receive buffers: values read into warm buffers that come back once decoded -- and a buffer whose
payload a caller holds never comes back, so no later read overwrites bytes someone still reads."""
from __future__ import annotations

import os

import torch

from storage.remote.recv_buffers import RecvBuffers
from storage.remote.tier import RemoteTier
from storage.remote.url import parse_remote_url
from tests.storage.conftest import fleet, TINY, block_data, keys
from tests.storage.test_tiered_cache import same_bits


def test_a_buffer_given_back_is_taken_again_and_views_are_exactly_the_size_asked() -> None:
    rb = RecvBuffers(max_bytes=1 << 20)
    a = rb.take(100_000)
    assert len(a) == 100_000 and not a.readonly
    a[:3] = b"abc"
    rb.give(a)
    b = rb.take(99_000)                        # the same 64 KiB-rounded class: the same buffer
    assert b.obj is a.obj and len(b) == 99_000 and bytes(b[:3]) == b"abc"
    c = rb.take(100_000)                       # none free now: a new one
    assert c.obj is not a.obj
    assert (rb.reused, rb.allocated) == (1, 2)


def test_what_it_keeps_is_bounded_and_foreign_objects_are_ignored() -> None:
    rb = RecvBuffers(max_bytes=3 << 16)
    views = [rb.take(1 << 16) for _ in range(5)]
    for v in views:
        rb.give(v)
    assert rb.kept_bytes() == 3 << 16          # two were dropped to the garbage collector
    rb.give(b"x" * (1 << 16))                  # redis-py's bytes (its fallback path): not ours
    rb.give(memoryview(bytearray(1000)))       # not a 64 KiB-grain buffer: not ours
    assert rb.kept_bytes() == 3 << 16


def test_reads_reuse_buffers_and_never_touch_a_payload_handed_to_the_caller(valkey) -> None:
    ns = os.urandom(32)
    ks = keys(24, ns=ns)
    rt = RemoteTier(parse_remote_url(valkey.url), TINY, secret=fleet(), timeout_s=5.0)
    try:
        for k in ks:
            assert rt.put(k, block_data(k))
        assert rt.drain(10)
        held: list = [None] * 8
        got = rt.get_many(ks[:8], payloads=held)               # the caller keeps 8 payloads
        assert all(g is not None for g in got) and all(p is not None for p in held)
        snapshot = [bytes(p) for p in held]
        for _ in range(3):                                     # reads that hand nothing over
            outs = [torch.empty(TINY.shape, dtype=TINY.dtype) for _ in ks[8:]]
            got = rt.get_many(ks[8:], outs)
            assert all(same_bits(g, block_data(k)) for g, k in zip(got, ks[8:]))
        assert rt._recv.reused >= 16                           # the later reads ran on warm buffers
        assert [bytes(p) for p in held] == snapshot            # ...never on the ones handed over
        kept = {id(p.obj) for p in held}
        with rt._recv._lock:
            free = {id(b) for bufs in rt._recv._free.values() for b in bufs}
        assert not kept & free
    finally:
        rt.close()
