"""Issue 18, item 3: compression on the write path runs on a pool, one batch ahead of the commits.

The disk and remote writers encode on their pools while the previous batch commits (or is sent):
many blocks put from several threads still read back bit-identical, a block that cannot be
encoded is counted as before and takes no other block with it, and a delete that races the
look-ahead is never undone by the batch before it.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from storage.disk.tier import DiskTier
from storage.layout import BlockLayout
from storage.lower_tier import private_copy
from tests.storage.conftest import block_data, keys
from tests.storage.test_remote_tier import tier as remote_tier
from tests.storage.test_tiered_cache import same_bits

# Blocks large enough that every batch takes real encoding work (16 KiB of bf16 each).
MID = BlockLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
CAP = 64 << 20


def bad_block() -> torch.Tensor:
    """A block the codec cannot encode: 9 dims, one more than its header holds (a real refusal,
    raised by Codec.encode on the writer's pool)."""
    return torch.zeros((1,) * 8 + (4,), dtype=torch.float32)


def put_from_threads(put, items: list, threads: int = 4) -> None:
    errors: list[BaseException] = []

    def run(part: list) -> None:
        try:
            for key, block in part:
                assert put(key, block)
        except BaseException as e:   # noqa: BLE001 -- reported by the test thread
            errors.append(e)
    workers = [threading.Thread(target=run, args=(items[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not errors, errors


def test_blocks_put_from_several_threads_read_back_bit_identical(tmp_path: Path) -> None:
    ks = keys(160, layout=MID)
    # Small batches and queue: many look-ahead turns, and puts waiting for room meanwhile.
    with DiskTier(str(tmp_path), CAP, layout=MID, batch_blocks=4, queue_blocks=8, encode_threads=3) as t:
        put_from_threads(t.put, [(k, block_data(k, MID)) for k in ks])
        assert t.drain(timeout=120)
        s = t.stats()
        assert (s.blocks, s.write_errors, s.pending_writes) == (len(ks), 0, 0)
        outs = [torch.empty(MID.shape, dtype=MID.dtype) for _ in ks]
        got = t.get_many(ks, outs)
        assert all(g is not None and same_bits(g, block_data(k, MID)) for g, k in zip(got, ks))
        assert t.check() == []
    with DiskTier(str(tmp_path), CAP, layout=MID) as t:     # committed: a new process reads them too
        assert all(same_bits(t.get(k), block_data(k, MID)) for k in ks[::7])


def test_one_encode_thread_still_writes_everything(tmp_path: Path) -> None:
    ks = keys(24)
    with DiskTier(str(tmp_path), CAP, batch_blocks=3, encode_threads=1) as t:
        put_from_threads(t.put, [(k, block_data(k)) for k in ks], threads=2)
        assert t.drain(timeout=60)
        assert all(same_bits(t.get(k), block_data(k)) for k in ks)


def test_with_no_encode_pool_to_be_had_the_writer_encodes_on_its_own_thread(tmp_path: Path) -> None:
    # What an exiting interpreter does to the pool (its submit raises RuntimeError), done by hand:
    # every block, and one that cannot encode among them, is handled on the writer thread.
    ks = keys(9)
    with DiskTier(str(tmp_path), CAP, batch_blocks=4, encode_process=None) as t:   # (the pool's fallback)
        t.put(ks[0], block_data(ks[0]))
        assert t.drain(timeout=60)
        t._writer._encoding.pool.shutdown()                  # built by the first batch
        mark = t.write_failures()
        for k in ks[1:]:
            t.put(k, bad_block() if k is ks[5] else block_data(k))
        assert t.drain(timeout=60, since=mark) is False       # the bad block, lost and counted
        assert (t.stats().blocks, t.write_failures()) == (8, mark + 1)
        assert all(same_bits(t.get(k), block_data(k)) for k in ks if k is not ks[5])
        assert t.get(ks[5]) is None and t.check() == []


def test_a_block_that_fails_to_encode_is_counted_and_drops_nothing_else(tmp_path: Path) -> None:
    ks = keys(21)
    bad = ks[10]
    with DiskTier(str(tmp_path), CAP, batch_blocks=4) as t:
        mark = t.write_failures()
        items = [(k, bad_block() if k is bad else block_data(k)) for k in ks]
        put_from_threads(t.put, items, threads=3)
        assert t.drain(timeout=60, since=mark) is False      # one block was lost
        s = t.stats()
        assert (s.write_errors, s.blocks, s.pending_writes) == (1, 20, 0)
        assert t.write_failures() == mark + 1
        assert not t.contains(bad) and t.get(bad) is None
        assert all(same_bits(t.get(k), block_data(k)) for k in ks if k is not bad)
        assert t.check() == []
        mark = t.write_failures()
        t.put(keys(1, start_token=500)[0], block_data(keys(1, start_token=500)[0]))
        assert t.drain(timeout=60, since=mark) is True     # the writer goes on


def test_a_delete_in_the_writers_hands_is_not_undone_by_the_batch_before(tmp_path: Path) -> None:
    # The writer loop's order, driven by hand with its condition held (the thread waits): batch k
    # holds X's first put; X is deleted, put again, taken ahead as batch k+1 and deleted again;
    # then k commits and k+1 commits. The second delete must stand, and a put never deleted must land.
    x, y = keys(2)
    with DiskTier(str(tmp_path), CAP, batch_blocks=1) as t:
        w = t._writer
        with w._cond:
            t.put(x, block_data(x))
            k = w._take()
            w._prepare(k)
            w._ready(k)
            assert t.delete(x)                 # X's first put, in the writer's hands
            t.put(x, block_data(x))            # X again: pending, queued
            ahead = w._take()                  # taken ahead while k commits
            w._prepare(ahead)
            assert t.delete(x)                 # X's second put, in the writer's hands too
            assert w._write(k)
            w._after(k, True)
            w._ready(ahead)
            assert w._write(ahead)
            w._after(ahead, True)
            # And a re-put that is not deleted lands, though the put before it was.
            t.put(y, block_data(y))
            k = w._take()
            w._prepare(k)
            w._ready(k)
            assert t.delete(y)
            t.put(y, block_data(y))
            ahead = w._take()
            w._prepare(ahead)
            assert w._write(k)
            w._after(k, True)
            w._ready(ahead)
            assert w._write(ahead)
            w._after(ahead, True)
        assert t.drain(timeout=60)
        assert not t.contains(x) and t.get(x) is None
        assert same_bits(t.get(y), block_data(y))
        assert t.stats().blocks == 1 and t.check() == []


def test_private_copy_is_bit_identical_and_owns_its_memory() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        b = torch.randn(3, 2, 4, 2, 8).to(dtype)
        for src in (b, b.transpose(0, 2)):     # contiguous (one memcpy) and strided (torch)
            c = private_copy(src)
            assert c.is_contiguous() and c.dtype == src.dtype and c.shape == src.shape
            assert torch.equal(c, src) and c.data_ptr() != src.data_ptr()
        c = private_copy(b)
        b.zero_()
        assert not torch.equal(c, b)


def test_remote_blocks_put_from_several_threads_read_back_and_a_bad_one_is_counted(valkey) -> None:
    ns = os.urandom(32)
    ks = keys(61, ns=ns)
    bad = ks[30]
    rt = remote_tier(valkey.url, batch_blocks=4, queue_blocks=256, encode_threads=3)
    try:
        items = [(k, bad_block() if k is bad else block_data(k)) for k in ks]
        put_from_threads(lambda k, b: rt.put(k, b, wait=True, timeout=60), items)
        assert rt.drain(60)                    # as before: a block that cannot be encoded is an error, not a lost batch
        s = rt.stats()
        assert (s.writes, s.write_errors, s.write_drops, s.pending_writes) == (60, 1, 0, 0)
        good = [k for k in ks if k is not bad]
        got = rt.get_many(good)
        assert all(g is not None and same_bits(g, block_data(k)) for g, k in zip(got, good))
        assert rt.get(bad) is None
    finally:
        rt.close()
