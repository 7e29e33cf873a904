"""Issue 7, item 1 and 7: a stored payload serves only the block it was written for.

Each attack edits a real data.mdb behind a closed tier (the way a damaged page pointer, a
misplaced record or a hostile writer would), then opens the tier and asks for the block: the
answer must be a counted miss that deletes the record, never another block's KV, and
`verify()` must report exactly the damaged blocks. The attacks on payloads run for both codecs
(written with one, read by a tier configured with the other).
"""
from __future__ import annotations

import threading
from pathlib import Path

import lmdb
import pytest

from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits

CAP = 64 << 20
KINDS = ["zstd", "raw", "nibble"]
OTHER = {"zstd": Codec(kind="raw"), "raw": Codec(kind="nibble"), "nibble": Codec(kind="zstd")}


def edit(path: Path, fn) -> None:
    """Run fn(txn, dbs) in a write transaction of the tier's environment (tier closed)."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        dbs = {n: env.open_db(n.encode()) for n in ("payload", "meta", "lru", "info")}
        with env.begin(write=True) as txn:
            fn(txn, dbs)
    finally:
        env.close()


def stored(n: int, path: Path, kind: str = "zstd") -> None:
    with DiskTier(str(path), CAP, Codec(kind=kind)) as t:
        for i in range(n):
            t.put(make_key(i), make_block(i))


@pytest.mark.parametrize("kind", KINDS)
def test_another_blocks_intact_payload_under_a_key_is_refused(tmp_path: Path, kind: str) -> None:
    stored(4, tmp_path, kind)
    a, b = make_key(1), make_key(2)

    def swap(txn, dbs):   # b's payload (intact, checksummed) now stands under a's key,
        p = bytes(txn.get(b.hash, db=dbs["payload"]))          # with metadata that agrees
        m = BlockMeta.unpack(bytes(txn.get(a.hash, db=dbs["meta"])))
        m.stored_size = len(p)
        txn.put(a.hash, p, db=dbs["payload"])
        txn.put(a.hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, swap)
    with DiskTier(str(tmp_path), CAP, OTHER[kind]) as t:
        report = t.verify()
        assert [(d.key, "bound to another block" in d.reason) for d in report.damaged] == [(a.hash, True)]
        for _ in range(3):            # asked again and again: never b's bytes
            assert t.get(a) is None
        s = t.stats()
        assert (s.corrupt, s.blocks) == (1, 3)
        assert same_bits(t.get(b), make_block(2))


@pytest.mark.parametrize("kind", KINDS)
def test_payloads_rotated_among_keys_are_all_refused(tmp_path: Path, kind: str) -> None:
    # What a bit flip in LMDB's overflow page numbers does: each key's value points at a
    # neighbour's pages. Every one is refused, none served.
    stored(5, tmp_path, kind)
    ks = [make_key(i) for i in range(5)]

    def rotate(txn, dbs):   # with metadata sizes that agree, as between same-size neighbours
        vals = [bytes(txn.get(k.hash, db=dbs["payload"])) for k in ks]
        for k, v in zip(ks, vals[1:] + vals[:1]):
            m = BlockMeta.unpack(bytes(txn.get(k.hash, db=dbs["meta"])))
            m.stored_size = len(v)
            txn.put(k.hash, v, db=dbs["payload"])
            txn.put(k.hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, rotate)
    with DiskTier(str(tmp_path), CAP, OTHER[kind]) as t:
        assert len(t.verify().damaged) == 5
        assert t.get_many(ks) == [None] * 5
        assert t.stats().corrupt == 5 and t.stats().blocks == 0


def test_a_damaged_namespace_is_caught_by_verify_and_never_served(tmp_path: Path) -> None:
    stored(3, tmp_path)
    k = make_key(1)

    def damage_namespace(txn, dbs):
        m = BlockMeta.unpack(bytes(txn.get(k.hash, db=dbs["meta"])))
        m.namespace = bytes([m.namespace[0] ^ 0x01]) + m.namespace[1:]
        txn.put(k.hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, damage_namespace)
    with DiskTier(str(tmp_path), CAP, readonly=True) as ro:
        assert [d.key for d in ro.verify().damaged] == [k.hash]
    with DiskTier(str(tmp_path), CAP) as t:
        assert t.verify(repair=True).repaired == 1
        assert t.verify().damaged == () and t.get(k) is None
        assert same_bits(t.get(make_key(0)), make_block(0)) and same_bits(t.get(make_key(2)), make_block(2))


@pytest.mark.parametrize("kind", KINDS)
def test_trailing_bytes_after_a_stored_frame_are_refused(tmp_path: Path, kind: str) -> None:
    stored(2, tmp_path, kind)
    k = make_key(0)

    def append_junk(txn, dbs):
        p = bytes(txn.get(k.hash, db=dbs["payload"])) + b"junk"
        m = BlockMeta.unpack(bytes(txn.get(k.hash, db=dbs["meta"])))
        m.stored_size = len(p)                   # the metadata agrees: only the codec can tell
        txn.put(k.hash, p, db=dbs["payload"])
        txn.put(k.hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, append_junk)
    with DiskTier(str(tmp_path), CAP, OTHER[kind]) as t:
        assert [d.key for d in t.verify().damaged] == [k.hash]
        assert t.get(k) is None and t.stats().corrupt == 1


def test_verify_of_a_live_evicting_cache_reports_no_damage(tmp_path: Path) -> None:
    # Item 7: blocks evicted between verify's listing and its reads are gone, not damaged.
    # Enough small blocks for several of verify's read chunks, and a writer evicting meanwhile.
    shape = (1, 2, 16, 1, 8)
    n = 1500
    with DiskTier(str(tmp_path), n * make_block(0, shape=shape).numel() * 4, batch_blocks=64) as t:
        for i in range(n):
            t.put(make_key(i), make_block(i, shape=shape))
        t.drain()
        stop = threading.Event()

        def churn() -> None:
            i = n
            while not stop.is_set():
                t.put(make_key(i), make_block(i, shape=shape))
                i += 1
        writer = threading.Thread(target=churn)
        writer.start()
        try:
            reports = [t.verify() for _ in range(3)]
        finally:
            stop.set()
            writer.join()
        t.drain()
        assert t.stats().evictions > 0
        assert [r.damaged for r in reports] == [()] * 3
        assert t.check() == []


# ---- payloads of codec format 3, already on disk, stay served ----------------------------------

def encode_v3(block, binding: bytes, shuffle: bool) -> bytes:
    """A codec format-3 payload as the previous build wrote it (storage/codec/header.py's docstring):
    header, crc32 of it, one zstd frame of the (optionally byte-shuffled) block."""
    import struct
    import zlib

    import torch
    import zstandard

    from storage.codec import byte_planes

    raw = byte_planes.split(block).reshape(-1) if shuffle else block.reshape(-1).view(torch.uint8).numpy()
    code = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}[block.dtype]
    header = (struct.pack("<4sBBBbB", b"TKVB", 3, int(shuffle), code, 3, block.dim())
              + struct.pack(f"<{block.dim()}I", *block.shape) + struct.pack("<Q", raw.size)
              + bytes((len(binding),)) + binding)
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(raw)
    return header + struct.pack("<I", zlib.crc32(header)) + frame


def test_the_v3_writer_here_is_the_one_that_wrote_the_golden_fixtures() -> None:
    import torch
    fixtures = Path(__file__).resolve().parent.parent / "fixtures"
    raw = bytearray((fixtures / "codec_v3_bfloat16_shuffled.raw").read_bytes())
    block = torch.frombuffer(raw, dtype=torch.bfloat16).reshape(2, 2, 4, 2, 8)
    assert encode_v3(block, bytes(range(64)), True) == (fixtures / "codec_v3_bfloat16_shuffled.tkvb").read_bytes()


def test_v3_payloads_written_by_an_earlier_build_are_served(tmp_path: Path) -> None:
    from storage.codec.stored_block import payload_binding

    stored(4, tmp_path)
    keys = {i: make_key(i) for i in range(4)}

    def downgrade(txn, dbs):   # blocks 1 and 2 as format 3 wrote them; block 3 gets block 0's (both fp32)
        for i, src, shuffle in ((1, 1, False), (2, 2, True), (3, 0, False)):
            p = encode_v3(make_block(src), payload_binding(keys[src].hash, keys[src].namespace), shuffle)
            m = BlockMeta.unpack(bytes(txn.get(keys[i].hash, db=dbs["meta"])))
            m.stored_size = len(p)
            txn.put(keys[i].hash, p, db=dbs["payload"])
            txn.put(keys[i].hash, m.pack(), db=dbs["meta"])
    edit(tmp_path, downgrade)
    with DiskTier(str(tmp_path), CAP) as t:
        assert [(d.key, "bound to another block" in d.reason) for d in t.verify().damaged] == [(keys[3].hash, True)]
        for i in (0, 1, 2):
            assert same_bits(t.get(keys[i]), make_block(i))
        assert t.get(keys[3]) is None
        assert t.stats().blocks == 3
