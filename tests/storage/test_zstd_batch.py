"""Issue 38, item 1, for the default codec: a get_many's zstd blocks checked and decoded by the
compiled batch (storage/codec/block_batch.py, _block_batch.c, block_checks.h, zstd_planes.h: libzstd
loaded at import, the GIL released) get the verdict the Python path gives (verify_and_decode) for
every block -- good (stored planes as raw-block frames or as zstd frames, all-zero planes, dim-1-major
or not), or damaged in its header, plane table, coded frames, stored frames, binding, length or
metadata, or forged with a valid header and coded crc32 around a frame zstd's decoder would take but
the codec refuses (its unused bit, no checksum, another content size, a second frame) -- and serve
the same bits; the disk tier counts and deletes what it refuses. The batch must decide every zstd
block itself (a skipped check would serve a damaged block: the verdicts here then differ)."""
from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from storage.codec import block_batch
from storage.codec.header import PlaneFrame, crc32, pack_header
from storage.codec.payload import Codec
from storage.codec.stored_block import verify_and_decode
from storage.disk.tier import DiskTier
from storage.layout import BlockLayout
from tests.storage.disk_tier_child import make_key, same_bits
from tests.storage.test_disk_binding import edit
from tests.storage.test_raw_batch import Record, every_damage_decided_alike, flip, with_meta
from tests.storage.test_nibble_batch import kv_block, layout_of, resized

SHAPE = (2, 2, 16, 3, 8)
BIG = (8, 2, 16, 8, 128)      # 512 KiB in bf16: a batch of them is spread over the batch's threads
ZSTD = Codec(kind="zstd")


def record(i: int, dtype: torch.dtype, shape: tuple[int, ...] = SHAPE, block: torch.Tensor | None = None) -> Record:
    from storage.codec.stored_block import BlockMeta, payload_binding
    key = make_key(i)
    block = kv_block(i, dtype, shape) if block is None else block
    payload = ZSTD.encode(block, payload_binding(key.hash, key.namespace))
    meta = BlockMeta(key.parent, key.namespace, key.token_ids, block.nbytes, len(payload), 0.0, 0, 0)
    return Record(key, payload, meta.pack())


def frames_of(payload: bytes) -> tuple[list[bytes], list[bool]]:
    h = ZSTD.check_header(payload)
    at, frames = h.header_size, []
    for p in h.planes:
        frames.append(payload[at:at + p.length])
        at += p.length
    return frames, [p.coded for p in h.planes]


def rebuilt(payload: bytes, frames: list[bytes], coded: list[bool] | None = None, flags_or: int = 0) -> bytes:
    """The payload with these frames under a header whose plane table, coded crc32 and header crc32
    are made to match: what no damage writes, so only the frames' own checks can refuse it."""
    h = ZSTD.check_header(payload)
    coded = [p.coded for p in h.planes] if coded is None else coded
    crc = 0
    for f, c in zip(frames, coded):
        if c:
            crc = crc32(f, crc)
    head, tail = pack_header(h.dtype, h.shape, h.raw_size, h.binding,
                             [PlaneFrame(c, len(f)) for f, c in zip(frames, coded)], level=h.level,
                             dim1_major=h.dim1_major, coded_crc=crc)
    if flags_or:
        head = bytearray(head)
        head[5] |= flags_or
        tail = struct.pack("<I", crc32(bytes(head)))
    return bytes(head) + tail + b"".join(frames)


def coded_plane(r: Record) -> tuple[int, np.ndarray]:
    """The coded plane's index and its bytes (decoded by zstd)."""
    frames, coded = frames_of(r.payload)
    b = coded.index(True)
    n = ZSTD.check_header(r.payload).numel
    return b, np.frombuffer(zstandard.ZstdDecompressor().decompress(frames[b], max_output_size=n), dtype=np.uint8)


def damaged(dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, tuple[Record, str]]:
    """Each damage as a record asked for under key 0's key (or its own), with a word both paths' reasons hold."""
    r, other = record(0, dtype, shape), record(1, dtype, shape)
    h = ZSTD.check_header(r.payload)
    frames, coded = frames_of(r.payload)
    b, plane = coded_plane(r)
    stored = coded.index(False)                  # plane 0: a raw-block frame (mantissa bits are noise)
    at = [h.header_size + sum(len(f) for f in frames[:k]) for k in range(len(frames))]
    binding_at = 9 + 4 * len(shape) + 8
    table_at = h.header_size - 4 - 4 - 5 * len(frames)

    def with_frame(k: int, frame: bytes) -> Record:
        fs = list(frames)
        fs[k] = frame
        return resized(r, rebuilt(r.payload, fs))

    mode_forged = bytearray(r.payload)
    mode_forged[table_at] = 2
    struct.pack_into("<I", mode_forged, h.header_size - 4, crc32(bytes(mode_forged[:h.header_size - 4])))
    cz = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    return {
        "header dims": (Record(r.key, flip(r.payload, 9), r.meta), "header crc32"),
        "header binding": (Record(r.key, flip(r.payload, binding_at + 3, 3), r.meta), "header crc32"),
        "header plane table": (Record(r.key, flip(r.payload, table_at + 2), r.meta), "header crc32"),
        "header coded crc field": (Record(r.key, flip(r.payload, h.header_size - 6, 2), r.meta), "header crc32"),
        "header crc": (Record(r.key, flip(r.payload, h.header_size - 1), r.meta), "header crc32"),
        "magic": (Record(r.key, flip(r.payload, 0), r.meta), "magic"),
        "a plane's mode, crc valid": (resized(r, bytes(mode_forged)), "unknown mode"),
        "coded frame's middle": (Record(r.key, flip(r.payload, at[b] + len(frames[b]) // 2, 4), r.meta),
                                 "coded planes' crc32"),
        "coded frame's last byte": (Record(r.key, flip(r.payload, at[b] + len(frames[b]) - 1), r.meta),
                                    "coded planes' crc32"),
        "stored plane's first byte": (Record(r.key, flip(r.payload, at[stored] + 12, 1), r.meta),
                                      "content checksum"),
        "stored plane's checksum": (Record(r.key, flip(r.payload, at[stored] + len(frames[stored]) - 2), r.meta),
                                    "content checksum"),
        "stored frame's block header": (Record(r.key, flip(r.payload, at[stored] + 8, 1), r.meta), "zstd"),
        "forged: coded frame's unused bit": (with_frame(b, flip(frames[b], 4, 4)), "zstd"),
        "forged: coded frame's content checksum": (with_frame(b, flip(frames[b], len(frames[b]) - 1, 3)), "zstd"),
        "forged: coded frame without a checksum": (
            with_frame(b, zstandard.ZstdCompressor(write_checksum=False, write_content_size=True).compress(plane)),
            "zstd"),
        "forged: coded frame of another size": (with_frame(b, cz.compress(plane[:-1])), "zstd"),
        "forged: a second frame after it": (with_frame(b, frames[b] + cz.compress(b"\0")), "zstd"),
        "bound to another block": (resized(r, other.payload), "bound to another block"),
        "truncated by a byte": (resized(r, r.payload[:-1]), "plane table"),
        "truncated into its header": (resized(r, r.payload[:20]), "truncated"),
        "record size": (Record(r.key, r.payload, with_meta(r, stored_size=len(r.payload) + 1)), "metadata"),
        "raw size": (Record(r.key, r.payload, with_meta(r, raw_size=7)), "header raw size"),
        "wrong key": (Record(other.key, r.payload, r.meta), "token ids"),
        "namespace": (Record(r.key, r.payload, with_meta(r, namespace=b"x" * 32)), "namespace"),
        "parent": (Record(r.key, r.payload, with_meta(r, parent=bytes(32))), "parent"),
        "metadata damaged": (Record(r.key, r.payload, r.meta[:-1]), "metadata record damaged"),
        "payload missing": (Record(r.key, None, r.meta), "payload missing"),
        "metadata missing": (Record(r.key, r.payload, None), "metadata missing"),
    }


def python_verdict(layout: BlockLayout | None, r: Record) -> tuple[torch.Tensor | None, str | None]:
    return verify_and_decode(ZSTD, layout, r.key, None, r.payload, r.meta)


@pytest.fixture(autouse=True)
def compiled() -> None:
    assert block_batch.AVAILABLE and block_batch.ZSTD, (
        "storage/codec/_block_batch.c was not built, or libzstd.so.1 was not found: zstd disk reads take the "
        "Python path, ~40-60 us a block holding the GIL")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_layout", [True, False])
@pytest.mark.parametrize("shape", [SHAPE, BIG])
def test_every_damage_is_the_same_miss_on_both_paths_and_decided_in_c(
        dtype: torch.dtype, with_layout: bool, shape: tuple[int, ...]) -> None:
    layout = layout_of(dtype, shape) if with_layout else None
    every_damage_decided_alike(ZSTD, layout, record(0, dtype, shape), kv_block(0, dtype, shape), damaged(dtype, shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPE, BIG, (4, 1, 16, 2, 8)])
def test_good_blocks_serve_the_same_bits_into_their_destinations(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Planes dim-1-major (SHAPE, BIG) and not (a dim 1 of 1); an all-zero block (its stored planes
    zstd frames, not raw blocks); a block whose stored plane is a zstd frame written by another
    encoder (any frame zstd writes is read); half the destinations shaped as the block, half flat.
    A layout's dim 1 is K and V (2): the other shape is read without one (its first header's)."""
    layout = layout_of(dtype, shape) if shape[1] == 2 else None
    records = [record(i, dtype, shape) for i in range(10)]
    records.append(record(10, dtype, shape, torch.zeros(shape, dtype=dtype)))
    r = record(11, dtype, shape)
    frames, coded = frames_of(r.payload)
    n = ZSTD.check_header(r.payload).numel
    plane0 = zstandard.ZstdDecompressor().decompress(frames[0], max_output_size=n)
    frames[0] = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(plane0)
    records.append(resized(r, rebuilt(r.payload, frames)))
    expect = [kv_block(i, dtype, shape) for i in range(10)] + [torch.zeros(shape, dtype=dtype), kv_block(11, dtype, shape)]
    assert ZSTD.check_header(records[0].payload).dim1_major == (shape[1] > 1)
    outs = [torch.full(shape, 7.0, dtype=dtype) if i % 2 else torch.empty(math.prod(shape), dtype=dtype)
            for i in range(len(records))]
    verdicts = block_batch.verify_batch(layout, [r.key for r in records], outs, [r.payload for r in records],
                                        [r.meta for r in records], 2)
    for r, out, want, (tensor, reason) in zip(records, outs, expect, verdicts):
        py_tensor, _ = python_verdict(layout, r)
        assert reason is None and tensor.data_ptr() == out.data_ptr() and tuple(tensor.shape) == shape
        assert same_bits(tensor, py_tensor) and same_bits(tensor, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_batch_joins_into_destinations_at_any_alignment_and_nowhere_else(dtype: torch.dtype) -> None:
    """A batch past block_checks.h's STREAM_FROM (8 MiB) joins its planes with streaming stores where
    a destination row is 16-byte aligned and plain ones before that: destinations at every element
    offset within 16 bytes get the block's exact bits, and the bytes between them stay as they were."""
    shape, n = BIG, 18                                  # 9-18 MiB: streamed
    numel, gap = math.prod(shape), 64
    records = [record(i % 5, dtype, shape) for i in range(n)]
    flat = torch.full((n * (numel + gap),), -3.0, dtype=dtype)
    starts = [i * (numel + gap) + i % 8 for i in range(n)]          # offsets of 0-7 elements past a row
    outs = [flat[at:at + numel] for at in starts]
    verdicts = block_batch.verify_batch(layout_of(dtype, shape), [r.key for r in records], outs,
                                        [r.payload for r in records], [r.meta for r in records], 2)
    for i, (tensor, reason) in enumerate(verdicts):
        assert reason is None and same_bits(tensor, kv_block(i % 5, dtype, shape)), i
    written = torch.zeros(flat.numel(), dtype=torch.bool)
    for at in starts:
        written[at:at + numel] = True
    assert bool((flat[~written] == -3.0).all())


def test_dim1_major_flagged_on_a_shape_without_two_leading_dims_is_refused_on_both_paths() -> None:
    dtype, shape = torch.bfloat16, (1, 1, 16, 2, 8)
    r = record(0, dtype, shape)
    frames, _ = frames_of(r.payload)
    forged = resized(r, rebuilt(r.payload, frames, flags_or=0x02))
    # No layout (a layout's dim 1 is always 2): the batch's first header says what to expect.
    good = record(1, dtype, shape)
    v = block_batch.verify_batch(None, [good.key, forged.key], [None, None], [good.payload, forged.payload],
                                 [good.meta, forged.meta], 1)
    assert v[0] is not None and v[0][1] is None and same_bits(v[0][0], kv_block(1, dtype, shape))
    assert v[1] is not None and v[1][0] is None and "dim-1-major" in v[1][1]
    assert "dim-1-major" in python_verdict(None, forged)[1]


@pytest.mark.parametrize("c_path", [True, False])
def test_the_disk_tier_serves_good_blocks_and_counts_and_deletes_damaged_ones(
        tmp_path: Path, monkeypatch, c_path: bool) -> None:
    """Through a real store: damage written into data.mdb behind a closed tier; one get_many.
    The same answers with the compiled batch and without libzstd (the Python path)."""
    if not c_path:
        monkeypatch.setattr(block_batch, "ZSTD", False)     # as where libzstd.so.1 is missing
    dtype, n = torch.bfloat16, 16
    layout = layout_of(dtype)
    keys = [make_key(i) for i in range(n)]
    with DiskTier(str(tmp_path), 64 << 20, ZSTD, layout=layout) as t:
        for i, k in enumerate(keys):
            t.put(k, kv_block(i, dtype))
        assert t.drain(timeout=60)

    def damage(txn, dbs):
        p = {i: bytes(txn.get(keys[i].hash, db=dbs["payload"])) for i in (1, 4, 7, 9)}
        h = ZSTD.check_header(p[1]).header_size
        txn.put(keys[1].hash, flip(p[1], len(p[1]) - 5), db=dbs["payload"])      # the coded frame
        txn.put(keys[4].hash, flip(p[4], h + 20), db=dbs["payload"])             # the stored plane
        txn.put(keys[7].hash, p[9], db=dbs["payload"])                           # another block's
        txn.put(keys[9].hash, flip(p[9], 10), db=dbs["payload"])                 # the header
    edit(tmp_path, damage)
    bad = {1, 4, 7, 9}
    with DiskTier(str(tmp_path), 64 << 20, ZSTD, layout=layout) as t:
        outs = [torch.empty(SHAPE, dtype=dtype) for _ in range(n)]
        got = t.get_many(keys, outs)
        assert [i for i, g in enumerate(got) if g is None] == sorted(bad)
        assert all(same_bits(got[i], kv_block(i, dtype)) and got[i].data_ptr() == outs[i].data_ptr()
                   for i in range(n) if i not in bad)
        s = t.stats()
        assert (s.corrupt, s.blocks) == (len(bad), n - len(bad))
        assert all(not t.contains(keys[i]) for i in bad)


def test_verify_one_is_the_compiled_verdict_or_else_the_python_one(monkeypatch) -> None:
    """The remote tier's one-block check: served into its destination by the compiled check; a
    destination it does not take (another dtype) and a build without the compiled module get
    verify_and_decode's verdict; damage is refused either way."""
    r, damaged_one = record(0, torch.bfloat16), record(0, torch.bfloat16)
    damaged_one.payload = flip(r.payload, len(r.payload) - 3)
    layout = layout_of(torch.bfloat16)
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(block_batch, "_compiled", None)     # as without a C compiler at install
        out = torch.empty(SHAPE, dtype=torch.bfloat16)
        tensor, reason = block_batch.verify_one(ZSTD, layout, r.key, out, r.payload, r.meta)
        assert reason is None and tensor.data_ptr() == out.data_ptr() and same_bits(tensor, kv_block(0, torch.bfloat16))
        tensor, reason = block_batch.verify_one(ZSTD, layout, r.key, torch.empty(SHAPE, dtype=torch.float16),
                                                r.payload, r.meta)
        assert tensor is None and "does not fit out" in reason
        tensor, reason = block_batch.verify_one(ZSTD, layout, r.key, None, damaged_one.payload, damaged_one.meta)
        assert tensor is None and ("crc32" in reason or "zstd" in reason)
        assert block_batch.verify_one(ZSTD, layout, r.key, None, None, r.meta) == (None, "payload missing")
