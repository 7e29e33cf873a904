"""Issue 38, item 1, for the nibble codec: a get_many's nibble blocks checked, hashed and decoded by
the compiled batch (storage/codec/block_batch.py, _block_batch.c, block_checks.h, nibble_kernel.h)
get the verdict the Python path gives (verify_and_decode) for every block -- good (its top plane
coded with escapes, or stored), or damaged in its header, plane table, data, binding, length or
metadata, forged with a valid hash around a malformed coded plane, or asked for under the wrong
key -- and serve the same bits; the disk tier counts and deletes what it refuses. The batch must
decide every nibble block itself (a skipped check would serve a damaged block: the verdicts here
then differ)."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.codec import block_batch
from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta, payload_binding, verify_and_decode
from storage.disk.tier import DiskTier
from storage.layout import BlockLayout
from tests.storage.disk_tier_child import make_key, same_bits
from tests.storage.test_disk_binding import edit
from tests.storage.test_nibble import forge, malformed
from tests.storage.test_raw_batch import Record, every_damage_decided_alike, flip, layout_of, with_meta

SHAPE = (2, 2, 16, 3, 8)
BIG = (8, 2, 16, 8, 128)      # 512 KiB in bf16: a batch of them is spread over the batch's threads
NIBBLE = Codec(kind="nibble")


def kv_block(i: int, dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """KV-like values with a wide spread of magnitudes: a bf16 or fp32 block's top plane codes with
    escapes, an fp16 block's is stored (its top byte holds mantissa bits)."""
    g = torch.Generator().manual_seed(i)
    return (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(dtype)


def record(i: int, dtype: torch.dtype, codec: Codec = NIBBLE, shape: tuple[int, ...] = SHAPE) -> Record:
    key, block = make_key(i), kv_block(i, dtype, shape)
    payload = codec.encode(block, payload_binding(key.hash, key.namespace))
    meta = BlockMeta(key.parent, key.namespace, key.token_ids, block.nbytes, len(payload), 0.0, 0, 0)
    return Record(key, payload, meta.pack())


def resized(r: Record, payload: bytes) -> Record:
    """`payload` under r's key, its metadata's stored size made to match (damage the record sizes agree on)."""
    return Record(r.key, payload, with_meta(r, stored_size=len(payload)))


def table_forged(payload: bytes, plane: int, mode: int, length: int) -> bytes:
    """A plane table entry rewritten under a valid header crc32."""
    h = NIBBLE.check_header(payload)
    table_at = h.header_size - 4 - 8 - 5 * len(h.planes)
    bad = bytearray(payload)
    struct.pack_into("<BI", bad, table_at + 5 * plane, mode, length)
    struct.pack_into("<I", bad, h.header_size - 4, zlib.crc32(bytes(bad[:h.header_size - 4])))
    return bytes(bad)


def damaged(dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, tuple[Record, str]]:
    """Each damage as a record asked for under key 0's key (or its own), with a word both paths' reasons hold."""
    r, other = record(0, dtype, shape=shape), record(1, dtype, shape=shape)
    h = NIBBLE.check_header(r.payload)
    n, planes = h.numel, len(h.planes)
    top_at = h.header_size + (planes - 1) * n          # the top plane: coded (table, codes, escapes) or stored
    binding_at = 9 + 4 * len(shape) + 8
    cases = {
        "header dims": (Record(r.key, flip(r.payload, 9), r.meta), "header crc32"),
        "header binding": (Record(r.key, flip(r.payload, binding_at + 3, 3), r.meta), "header crc32"),
        "header plane table": (Record(r.key, flip(r.payload, binding_at + 1 + r.payload[binding_at] + 2), r.meta),
                               "header crc32"),
        "header xxh3 field": (Record(r.key, flip(r.payload, h.header_size - 8, 7), r.meta), "header crc32"),
        "header crc": (Record(r.key, flip(r.payload, h.header_size - 1), r.meta), "header crc32"),
        "magic": (Record(r.key, flip(r.payload, 0), r.meta), "magic"),
        "a stored plane's length, crc valid": (resized(r, table_forged(r.payload, 0, 0, n - 1)), "plane table"),
        "a lower plane coded, crc valid": (resized(r, table_forged(r.payload, 0, 1, n)), "plane table"),
        "a plane's mode, crc valid": (resized(r, table_forged(r.payload, planes - 1, 2, h.planes[-1].length)),
                                      "unknown mode"),
        "data first byte": (Record(r.key, flip(r.payload, h.header_size), r.meta), "xxh3"),
        "top plane's first byte": (Record(r.key, flip(r.payload, top_at, 2), r.meta), "xxh3"),
        "top plane's middle": (Record(r.key, flip(r.payload, top_at + (len(r.payload) - top_at) // 2, 5), r.meta),
                               "xxh3"),
        "data last byte": (Record(r.key, flip(r.payload, len(r.payload) - 1, 6), r.meta), "xxh3"),
        "bound to another block": (resized(r, other.payload), "bound to another block"),
        "truncated by a byte": (resized(r, r.payload[:-1]), "plane table"),
        "truncated into its header": (resized(r, r.payload[:20]), "truncated"),
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
    if h.planes[-1].coded:
        # Forged: a malformed coded plane under a hash, plane table and header crc made to match --
        # intact bytes no encoder of ours writes: refused by the decode, never served.
        data = r.payload[h.header_size:]
        low, coded = data[:(planes - 1) * n], bytearray(data[(planes - 1) * n:])
        for name, bad in malformed(np.frombuffer(bytes(coded), dtype=np.uint8).copy(), n).items():
            if bad.size >= 16 + (n + 1) // 2:
                cases[f"forged: {name}"] = (resized(r, forge(r.payload, low + bad.tobytes(), bad.size)), "malformed")
    return cases


def python_verdict(layout: BlockLayout | None, r: Record) -> tuple[torch.Tensor | None, str | None]:
    return verify_and_decode(NIBBLE, layout, r.key, None, r.payload, r.meta)


@pytest.fixture(autouse=True)
def compiled() -> None:
    assert block_batch.AVAILABLE, ("storage/codec/_block_batch.c was not built (no C compiler at `pip install -e .`?): "
                                   "nibble disk reads take the Python path, a block at a time holding the GIL")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_layout", [True, False])
@pytest.mark.parametrize("shape", [SHAPE, BIG])
def test_every_damage_is_the_same_miss_on_both_paths_and_decided_in_c(
        dtype: torch.dtype, with_layout: bool, shape: tuple[int, ...]) -> None:
    layout = layout_of(dtype, shape) if with_layout else None
    cases = damaged(dtype, shape)
    good = record(0, dtype, shape=shape)
    coded = NIBBLE.check_header(good.payload).planes[-1].coded
    assert coded == (dtype != torch.float16)        # both decodes: a coded top plane and a stored one
    if coded:
        assert any(name.startswith("forged") for name in cases)
    every_damage_decided_alike(NIBBLE, layout, good, kv_block(0, dtype, shape), cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPE, BIG])
def test_good_blocks_serve_the_same_bits_into_their_destinations(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    layout = layout_of(dtype, shape)
    records = [record(i, dtype, shape=shape) for i in range(12)]
    outs = [torch.full(shape, 7.0, dtype=dtype) if i % 2 else torch.empty(layout.numel, dtype=dtype)
            for i in range(12)]          # half shaped as the block, half flat: each is viewed as the block
    verdicts = block_batch.verify_batch(layout, [r.key for r in records], outs, [r.payload for r in records],
                                        [r.meta for r in records], 2)
    for i, (r, out, (tensor, reason)) in enumerate(zip(records, outs, verdicts)):
        py_tensor, _ = python_verdict(layout, r)
        assert reason is None and tensor.data_ptr() == out.data_ptr() and tuple(tensor.shape) == shape
        assert same_bits(tensor, py_tensor) and same_bits(tensor, kv_block(i, dtype, shape))


def test_a_batch_of_every_codec_decides_each_block() -> None:
    """A tier reads every codec it ever wrote: one batch of nibble, raw and zstd blocks, each
    decided by the batch (zstd's: tests/storage/test_zstd_batch.py)."""
    layout = layout_of(torch.bfloat16)
    rs = [record(0, torch.bfloat16), record(1, torch.bfloat16, Codec(kind="raw")),
          record(2, torch.bfloat16, Codec(kind="zstd"))]
    v = block_batch.verify_batch(layout, [r.key for r in rs], [None] * 3, [r.payload for r in rs],
                                 [r.meta for r in rs], 2)
    for i in (0, 1, 2):
        assert v[i] is not None and v[i][1] is None and same_bits(v[i][0], kv_block(i, torch.bfloat16))


@pytest.mark.parametrize("c_path", [True, False])
def test_the_disk_tier_serves_good_blocks_and_counts_and_deletes_damaged_ones(
        tmp_path: Path, monkeypatch, c_path: bool) -> None:
    """Through a real store: damage written into data.mdb behind a closed tier; one get_many.
    The same answers with the compiled batch and without it (the Python path, no compiler)."""
    if not c_path:
        monkeypatch.setattr(block_batch, "_compiled", None)     # as without a C compiler at install
        monkeypatch.setattr(block_batch, "AVAILABLE", False)
    dtype, n = torch.bfloat16, 16
    layout = layout_of(dtype)
    keys = [make_key(i) for i in range(n)]
    with DiskTier(str(tmp_path), 64 << 20, NIBBLE, layout=layout) as t:
        for i, k in enumerate(keys):
            t.put(k, kv_block(i, dtype))
        assert t.drain(timeout=60)

    def damage(txn, dbs):
        p = {i: bytes(txn.get(keys[i].hash, db=dbs["payload"])) for i in (1, 4, 7, 9)}
        h = NIBBLE.check_header(p[1]).header_size
        txn.put(keys[1].hash, flip(p[1], len(p[1]) - 5), db=dbs["payload"])      # data: the top plane
        txn.put(keys[4].hash, flip(p[4], 10), db=dbs["payload"])                 # header
        txn.put(keys[7].hash, p[9], db=dbs["payload"])                           # another block's
        txn.put(keys[9].hash, p[9][:h + 100], db=dbs["payload"])                 # truncated
        m = BlockMeta.unpack(bytes(txn.get(keys[9].hash, db=dbs["meta"])))
        m.stored_size = h + 100
        txn.put(keys[9].hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, damage)
    bad = {1, 4, 7, 9}
    with DiskTier(str(tmp_path), 64 << 20, NIBBLE, layout=layout) as t:
        outs = [torch.empty(SHAPE, dtype=dtype) for _ in range(n)]
        got = t.get_many(keys, outs)
        assert [i for i, g in enumerate(got) if g is None] == sorted(bad)
        assert all(same_bits(got[i], kv_block(i, dtype)) and got[i].data_ptr() == outs[i].data_ptr()
                   for i in range(n) if i not in bad)
        s = t.stats()
        assert (s.corrupt, s.blocks) == (len(bad), n - len(bad))
        assert all(not t.contains(keys[i]) for i in bad)
        again = t.get_many(keys)
        assert [i for i, g in enumerate(again) if g is None] == sorted(bad) and t.stats().corrupt == len(bad)
