"""Issue 38, item 1: the raw codec's blocks checked, hashed and copied by one compiled batch per
get_many (storage/codec/block_batch.py, _block_batch.c, block_checks.h) give the verdict the Python path gives
(verify_and_decode) for every block -- good, or damaged in its header, data, binding, length or
metadata, or asked for under the wrong key -- and serve the same bits; the disk tier counts and
deletes what it refuses. The C batch must decide every raw block itself (a skipped check would serve
a damaged block: the verdicts here then differ)."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest
import torch
import xxhash

from storage.codec import block_batch
from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta, payload_binding, verify_and_decode
from storage.disk.tier import DiskTier
from storage.hashing import BlockKey
from storage.layout import BlockLayout
from tests.storage.disk_tier_child import make_block, make_key, same_bits
from tests.storage.test_disk_binding import edit

SHAPE = (2, 2, 16, 3, 8)
BIG = (8, 2, 16, 8, 128)      # 512 KiB in bf16: a batch of them is spread over the call's threads (4 MiB each)
RAW = Codec(kind="raw")


def layout_of(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> BlockLayout:
    return BlockLayout(shape[0], shape[2], shape[3], shape[4], dtype)


@dataclass
class Record:
    key: BlockKey             # what the block is asked for under
    payload: bytes | None
    meta: bytes | None


def record(i: int, dtype: torch.dtype, codec: Codec = RAW, shape: tuple[int, ...] = SHAPE) -> Record:
    key, block = make_key(i), make_block(i, dtype, shape)
    payload = codec.encode(block, payload_binding(key.hash, key.namespace))
    meta = BlockMeta(key.parent, key.namespace, key.token_ids, block.nbytes, len(payload), 0.0, 0, 0)
    return Record(key, payload, meta.pack())


def flip(data: bytes, at: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[at] ^= 1 << bit
    return bytes(b)


def with_meta(r: Record, **fields) -> bytes:
    m = BlockMeta.unpack(r.meta)
    for name, value in fields.items():
        setattr(m, name, value)
    return m.pack()


def header_size(payload: bytes) -> int:
    return RAW.check_header(payload).header_size


def damaged(dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, tuple[Record, str]]:
    """Each damage as a record asked for under key 0's key (or its own), with a word both paths' reasons hold."""
    r = record(0, dtype, shape=shape)
    other = record(1, dtype, shape=shape)
    h = header_size(r.payload)
    cut = r.payload[:-1]
    short = r.payload[:20]
    swapped = Record(r.key, other.payload, with_meta(r, stored_size=len(other.payload)))
    return {
        "header dims": (Record(r.key, flip(r.payload, 9), r.meta), "header crc32"),
        "header binding": (Record(r.key, flip(r.payload, h - 30, 3), r.meta), "header crc32"),
        "header xxh3 field": (Record(r.key, flip(r.payload, h - 8, 7), r.meta), "header crc32"),
        "header crc": (Record(r.key, flip(r.payload, h - 1), r.meta), "header crc32"),
        "magic": (Record(r.key, flip(r.payload, 0), r.meta), "magic"),
        "data first byte": (Record(r.key, flip(r.payload, h), r.meta), "xxh3"),
        "data last byte": (Record(r.key, flip(r.payload, len(r.payload) - 1, 6), r.meta), "xxh3"),
        "data middle": (Record(r.key, flip(r.payload, (h + len(r.payload)) // 2, 1), r.meta), "xxh3"),
        "bound to another block": (swapped, "bound to another block"),
        "truncated by a byte": (Record(r.key, cut, with_meta(r, stored_size=len(cut))), "plane table"),
        "truncated into its header": (Record(r.key, short, with_meta(r, stored_size=len(short))), "truncated"),
        "record size": (Record(r.key, r.payload, with_meta(r, stored_size=len(r.payload) + 1)), "metadata"),
        "raw size": (Record(r.key, r.payload, with_meta(r, raw_size=7)), "header raw size"),
        "wrong key": (Record(other.key, r.payload, r.meta), "token ids"),
        "namespace": (Record(r.key, r.payload, with_meta(r, namespace=b"x" * 32)), "namespace"),
        "parent": (Record(r.key, r.payload, with_meta(r, parent=bytes(32))), "parent"),
        "metadata damaged": (Record(r.key, r.payload, r.meta[:-1]), "metadata record damaged"),
        "metadata version": (Record(r.key, r.payload, flip(r.meta, 0, 1)), "metadata record damaged"),
        "payload missing": (Record(r.key, None, r.meta), "payload missing"),
        "metadata missing": (Record(r.key, r.payload, None), "metadata missing"),
    }


def python_verdict(layout: BlockLayout | None, r: Record) -> tuple[torch.Tensor | None, str | None]:
    return verify_and_decode(RAW, layout, r.key, None, r.payload, r.meta)


def every_damage_decided_alike(codec: Codec, layout: BlockLayout | None, good: Record, block: torch.Tensor,
                               cases: dict[str, tuple[Record, str]]) -> None:
    """On 1, 2 and 3 threads: `good` served as `block`, and each damaged case decided by the batch
    (not left to Python: a skipped check would serve it) with a reason holding the case's word, as
    verify_and_decode's does. The good block first (without a layout the batch's first header is
    what the call expects) and last, the damaged ones between: with BIG blocks, every thread takes
    some of each."""
    records = [good] + [r for r, _ in cases.values()] + [good]
    for threads in (1, 2, 3):
        verdicts = block_batch.verify_batch(layout, [r.key for r in records], [None] * len(records),
                                            [r.payload for r in records], [r.meta for r in records], threads)
        assert verdicts is not None
        for served, reason in (verdicts[0], verdicts[-1]):
            assert reason is None and same_bits(served, block)
        for (name, (r, word)), verdict in zip(cases.items(), verdicts[1:-1]):
            assert verdict is not None, f"{name}: left to Python; the compiled batch must decide a {codec.kind} block"
            py_tensor, py_reason = verify_and_decode(codec, layout, r.key, None, r.payload, r.meta)
            assert py_tensor is None and word in py_reason, (name, py_reason)
            assert verdict[0] is None and word in verdict[1], (name, verdict)


@pytest.fixture(autouse=True)
def compiled() -> None:
    assert block_batch.AVAILABLE, ("storage/codec/_block_batch.c was not built (no C compiler at `pip install -e .`?): "
                                 "raw disk reads take the Python path, ~40 us a block holding the GIL")


@pytest.mark.parametrize("baseline", [False, True])
def test_its_xxh3_is_the_xxhash_packages(baseline: bool) -> None:
    """Streamed in the check's chunks, with the kernel it uses (AVX2 where the CPU has it) and the
    baseline one: the package's digest either way."""
    assert block_batch.kernel() in ("avx2", "sse2", "baseline")
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 65535, 65536, 65537, 368_640, 1_000_003):
        data = os.urandom(n)
        assert block_batch.xxh3_64(data, baseline) == xxhash.xxh3_64_intdigest(data), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_layout", [True, False])
@pytest.mark.parametrize("shape", [SHAPE, BIG])
def test_every_damage_is_the_same_miss_on_both_paths_and_decided_in_c(
        dtype: torch.dtype, with_layout: bool, shape: tuple[int, ...]) -> None:
    layout = layout_of(dtype, shape) if with_layout else None
    every_damage_decided_alike(RAW, layout, record(0, dtype, shape=shape), make_block(0, dtype, shape),
                               damaged(dtype, shape))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPE, BIG])
def test_good_blocks_serve_the_same_bits_into_their_destinations(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    layout = layout_of(dtype, shape)
    records = [record(i, dtype, shape=shape) for i in range(24)]
    outs = [torch.full(shape, 7.0, dtype=dtype) if i % 2 else torch.empty(layout.numel, dtype=dtype)
            for i in range(24)]          # half shaped as the block, half flat: each is viewed as the block
    verdicts = block_batch.verify_batch(layout, [r.key for r in records], outs, [r.payload for r in records],
                                      [r.meta for r in records], 2)
    for i, (r, out, (tensor, reason)) in enumerate(zip(records, outs, verdicts)):
        py_tensor, _ = python_verdict(layout, r)
        assert reason is None and tensor.data_ptr() == out.data_ptr() and tuple(tensor.shape) == shape
        assert same_bits(tensor, py_tensor) and same_bits(tensor, make_block(i, dtype, shape))


def test_what_it_cannot_decide_is_left_to_python() -> None:
    """A block of another shape without a layout, a destination of another dtype: undecided, so
    verify_and_decode's verdict (a zstd or nibble payload in a raw tier -- a tier reads every codec
    it wrote -- is decided)."""
    layout = layout_of(torch.float32)
    zstd = record(0, torch.float32, Codec(kind="zstd"))
    nibble = record(1, torch.float32, Codec(kind="nibble"))
    v = block_batch.verify_batch(layout, [zstd.key, nibble.key], [None, None], [zstd.payload, nibble.payload],
                               [zstd.meta, nibble.meta], 2)
    # zstd's and nibble's are decided too (tests/storage/test_zstd_batch.py, test_nibble_batch.py)
    assert v[0] is not None and v[0][1] is None and same_bits(v[0][0], make_block(0, torch.float32))
    assert v[1] is not None and v[1][1] is None
    a, b = record(2, torch.float32), record(3, torch.float16)
    v = block_batch.verify_batch(None, [a.key, b.key], [None, None], [a.payload, b.payload], [a.meta, b.meta], 1)
    assert v[0] is not None and v[0][1] is None and v[1] is None
    v = block_batch.verify_batch(layout, [a.key], [torch.empty(SHAPE, dtype=torch.float16)], [a.payload], [a.meta], 1)
    assert v == [None]
    assert python_verdict(None, b)[1] is None


@pytest.mark.parametrize("c_path", [True, False])
def test_the_disk_tier_serves_good_blocks_and_counts_and_deletes_damaged_ones(
        tmp_path: Path, monkeypatch, c_path: bool) -> None:
    """Through a real store: damage written into data.mdb behind a closed tier; one get_many.
    The same answers with the compiled check and without it (the Python path, no compiler)."""
    if not c_path:
        monkeypatch.setattr(block_batch, "_compiled", None)     # as without a C compiler at install
        monkeypatch.setattr(block_batch, "AVAILABLE", False)
    dtype, n = torch.bfloat16, 16
    layout = layout_of(dtype)
    keys = [make_key(i) for i in range(n)]
    with DiskTier(str(tmp_path), 64 << 20, RAW, layout=layout) as t:
        for i, k in enumerate(keys):
            t.put(k, make_block(i, dtype))
        assert t.drain(timeout=60)

    def damage(txn, dbs):
        p = {i: bytes(txn.get(keys[i].hash, db=dbs["payload"])) for i in (1, 4, 7, 9)}
        h = header_size(p[1])
        txn.put(keys[1].hash, flip(p[1], len(p[1]) - 5), db=dbs["payload"])      # data
        txn.put(keys[4].hash, flip(p[4], 10), db=dbs["payload"])                 # header
        txn.put(keys[7].hash, p[9], db=dbs["payload"])                           # another block's
        txn.put(keys[9].hash, p[9][:h + 100], db=dbs["payload"])                 # truncated
        for i, size in ((9, h + 100),):
            m = BlockMeta.unpack(bytes(txn.get(keys[i].hash, db=dbs["meta"])))
            m.stored_size = size
            txn.put(keys[i].hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, damage)
    bad = {1, 4, 7, 9}
    with DiskTier(str(tmp_path), 64 << 20, RAW, layout=layout) as t:
        outs = [torch.empty(SHAPE, dtype=dtype) for _ in range(n)]
        got = t.get_many(keys, outs)
        assert [i for i, g in enumerate(got) if g is None] == sorted(bad)
        assert all(same_bits(got[i], make_block(i, dtype)) and got[i].data_ptr() == outs[i].data_ptr()
                   for i in range(n) if i not in bad)
        s = t.stats()
        assert (s.corrupt, s.blocks) == (len(bad), n - len(bad))
        assert all(not t.contains(keys[i]) for i in bad)
        again = t.get_many(keys)
        assert [i for i, g in enumerate(again) if g is None] == sorted(bad) and t.stats().corrupt == len(bad)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_read_that_fails_midway_joins_the_batch_threads_and_misses(tmp_path: Path) -> None:
    """An LMDB error after half a get_many's blocks were handed to the batch (its thread already
    copying them, then waiting for more): every block of the read is a miss, the thread is joined
    before the read transaction ends, and the next read serves every block."""
    dtype, n = torch.bfloat16, 24            # 12 MiB of BIG blocks: the batch starts a thread
    layout = layout_of(dtype, BIG)
    keys = [make_key(i) for i in range(n)]
    with DiskTier(str(tmp_path), 256 << 20, RAW, layout=layout, decode_threads=2) as t:
        for i, k in enumerate(keys):
            t.put(k, make_block(i, dtype, BIG))
        assert t.drain(timeout=120)
        outs = [torch.empty(BIG, dtype=dtype) for _ in range(n)]
        assert all(g is not None for g in t.get_many(keys, outs))     # warm: lazily made threads exist
        before, real = os_threads(), t._begin
        calls = [0]

        class Failing:
            def __init__(self, txn):
                self.txn = txn

            def get(self, key, db=None):
                calls[0] += 1
                if calls[0] == n:            # the 12th payload: 11 blocks handed to the batch
                    raise lmdb.ReadersFullError("injected")
                return self.txn.get(key, db=db)

        at_end: list[int] = []

        @contextlib.contextmanager
        def failing(**kw):
            with real(**kw) as txn:
                try:
                    yield Failing(txn)
                finally:
                    at_end.append(os_threads())   # the transaction ends next: no thread may read the map
        t._begin = failing
        assert t.get_many(keys, outs) == [None] * n
        assert at_end == [before] and calls[0] == n and t.stats().read_errors == 1
        t._begin = real
        got = t.get_many(keys, outs)
        assert all(same_bits(got[i], make_block(i, dtype, BIG)) for i in range(n))
