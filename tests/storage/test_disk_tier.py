"""DiskTier on real LMDB files and real zstd: round trips, pending reads, exact LRU order,
verification failures, persistence and sharing across processes, crashes, a full map."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch

from storage.codec.stored_block import payload_binding
from storage.codec.payload import Codec
from storage.codec.verify_report import VerifyReport
from storage.disk.tier import DiskTier
from storage.layout import BlockLayout
from tests.storage.disk_tier_child import bits, make_block, make_key, same_bits

REPO = Path(__file__).resolve().parents[2]
CAP = 64 << 20
# Holds LMDB's (cross-process) write lock, so the tier's writer cannot commit meanwhile.
HOLD_WRITE_LOCK = ("import lmdb, sys\nenv = lmdb.open(sys.argv[1], max_dbs=4)\ntxn = env.begin(write=True)\n"
                   "print('locked', flush=True)\nsys.stdin.read()\ntxn.abort()\n")


def child(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.storage.disk_tier_child", *map(str, args)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def noise_block(i: int, shape: tuple[int, ...] = (2, 2, 16, 3, 8)) -> torch.Tensor:
    """Random float32 bit patterns: incompressible, so every payload of a shape has one size."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, generator=g).to(torch.int32).view(torch.float32)


def rewrite(path: Path, db: str, h: bytes, fn) -> None:
    """Change one stored value behind the tier's back (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        d = env.open_db(db.encode())
        with env.begin(write=True) as txn:
            txn.put(h, fn(bytes(txn.get(h, db=d))), db=d)
    finally:
        env.close()


def flip_middle_byte(v: bytes) -> bytes:
    b = bytearray(v)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_put_drain_get_is_bit_identical(tmp_path: Path, dtype: torch.dtype, kind: str) -> None:
    with DiskTier(str(tmp_path), CAP, Codec(kind=kind)) as t:
        for i in range(5):
            t.put(make_key(i), make_block(i, dtype))
        assert t.drain(timeout=30)
        for i in range(5):
            assert same_bits(t.get(make_key(i)), make_block(i, dtype))
        out = torch.empty(make_block(0).numel(), dtype=dtype)
        got = t.get(make_key(3), out=out)
        assert got.data_ptr() == out.data_ptr() and same_bits(got, make_block(3, dtype))
        s = t.stats()
        assert (s.blocks, s.store_hits, s.misses, s.corrupt, s.pending_writes) == (5, 6, 0, 0, 0)
        assert s.raw_bytes == 5 * make_block(0, dtype).numel() * dtype.itemsize
        assert s.bytes_written == s.used_bytes and s.compression_ratio == s.raw_bytes / s.used_bytes
        assert t.get(make_key(99)) is None and t.stats().misses == 1
        assert t.check() == []


def test_pending_block_is_found_and_queue_applies_backpressure(tmp_path: Path) -> None:
    t = DiskTier(str(tmp_path), CAP, queue_blocks=2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WRITE_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        block = make_block(1, torch.bfloat16)
        t.put(make_key(1), block)
        block.zero_()                       # the caller may reuse its memory once put returns
        assert t.stats().pending_writes == 1 and t.stats().blocks == 0
        assert t.contains(make_key(1))
        assert same_bits(t.get(make_key(1)), make_block(1, torch.bfloat16))
        out = torch.empty(make_block(1).numel(), dtype=torch.bfloat16)
        assert same_bits(t.get(make_key(1), out=out), make_block(1, torch.bfloat16))
        assert not t.drain(timeout=0.2)     # the writer waits on the other process's write lock
        t.put(make_key(2), make_block(2))
        third = threading.Thread(target=t.put, args=(make_key(3), make_block(3)))
        third.start()
        third.join(0.3)
        assert third.is_alive()             # queue_blocks=2 are pending: put blocks
    finally:
        holder.stdin.close()
        holder.wait(30)
    third.join(30)
    assert not third.is_alive() and t.drain(timeout=30)
    s = t.stats()
    assert (s.pending_writes, s.blocks, s.store_hits) == (0, 3, 2)
    for i, dtype in ((1, torch.bfloat16), (2, None), (3, None)):
        assert same_bits(t.get(make_key(i)), make_block(i, dtype))
    t.close()
    t.close()                                # idempotent


def test_capacity_bound_and_exact_lru_eviction_order(tmp_path: Path) -> None:
    codec = Codec()
    names = "ABCDE"
    keys = {n: make_key(i) for i, n in enumerate(names)}
    blocks = {n: noise_block(i) for i, n in enumerate(names)}
    sizes = {n: len(codec.encode(b, payload_binding(keys[n].hash, keys[n].namespace))) for n, b in blocks.items()}
    size = sizes["A"]
    assert set(sizes.values()) == {size}
    with DiskTier(str(tmp_path), 3 * size, codec) as t:
        for n in "ABC":
            t.put(keys[n], blocks[n])
        t.drain()
        assert t.get(keys["A"]) is not None          # A becomes the most recently used
        t.put(keys["D"], blocks["D"])
        t.drain()

        def present() -> set[str]:
            return {n for n in names if t.contains(keys[n])}
        assert present() == {"A", "C", "D"}
        assert (t.stats().used_bytes, t.stats().evictions) == (3 * size, 1)
        t.put(keys["E"], blocks["E"])
        t.drain()
        assert present() == {"A", "D", "E"}
        assert (t.stats().used_bytes, t.stats().blocks, t.stats().evictions) == (3 * size, 3, 2)
        by_age = sorted(t.iter_blocks(), key=lambda b: b.last_access)
        assert [b.hash for b in by_age] == [keys[n].hash for n in "ADE"]
        assert [b.reads for b in by_age] == [1, 0, 0]
        assert t.check() == []


@pytest.mark.parametrize("field", ["token_ids", "namespace", "parent"])
def test_key_mismatch_is_corrupt_and_deleted(tmp_path: Path, field: str) -> None:
    key = make_key(7)
    wrong = {"token_ids": tuple(range(16)), "namespace": b"\xee" * 32, "parent": b"\x00" * 32}[field]
    with DiskTier(str(tmp_path), CAP) as t:
        t.put(key, make_block(7))
        t.put(make_key(8), make_block(8))
        t.drain()
        assert t.get(dataclasses.replace(key, **{field: wrong})) is None
        s = t.stats()
        assert (s.corrupt, s.store_hits, s.misses, s.blocks) == (1, 0, 0, 1)
        assert not t.contains(key)
        assert t.get(key) is None and t.stats().misses == 1
        assert same_bits(t.get(make_key(8)), make_block(8))
        assert t.check() == []


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
@pytest.mark.parametrize("db,damage", [("payload", flip_middle_byte), ("payload", lambda v: v[:-9]),
                                       ("meta", lambda v: v[:-3])])
def test_damaged_stored_block_is_a_miss_and_deleted(tmp_path: Path, db: str, damage, kind: str) -> None:
    with DiskTier(str(tmp_path), CAP, Codec(kind=kind)) as t:
        for i in range(3):
            t.put(make_key(i), make_block(i))
    rewrite(tmp_path, db, make_key(1).hash, damage)
    with DiskTier(str(tmp_path), CAP) as t:
        assert t.get(make_key(1)) is None
        s = t.stats()
        # A damaged payload is found by the read that serves it; an undecodable meta record is
        # already deleted by the open, which recounts the store (records.repair_counters).
        assert (s.corrupt, s.store_hits, s.blocks) == ((1, 0, 2) if db == "payload" else (0, 0, 2))
        assert not t.contains(make_key(1))
        assert same_bits(t.get(make_key(0)), make_block(0)) and same_bits(t.get(make_key(2)), make_block(2))
        assert t.check() == []


def test_get_many_decodes_in_parallel_and_sorts_out_misses_and_damage(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path), CAP) as t:
        for i in range(6):
            t.put(make_key(i), make_block(i))
    rewrite(tmp_path, "payload", make_key(4).hash, flip_middle_byte)
    with DiskTier(str(tmp_path), CAP, decode_threads=2) as t:
        keys = [make_key(i) for i in (0, 1, 99, 4, 2, 3, 5)]
        outs = [torch.empty(make_block(i).numel(), dtype=make_block(i).dtype) for i in (0, 1, 0, 4, 2, 3, 5)]
        got = t.get_many(keys, outs)
        assert [g is None for g in got] == [False, False, True, True, False, False, False]
        for i, g, o in zip((0, 1, 99, 4, 2, 3, 5), got, outs):
            if g is not None:
                assert same_bits(g, make_block(i)) and g.data_ptr() == o.data_ptr()
        s = t.stats()
        assert (s.store_hits, s.misses, s.corrupt, s.blocks) == (5, 1, 1, 5)
        assert t.check() == []


def _flip_at(offset_of) -> object:
    """A damage: flip one bit at offset_of(payload) of a stored payload."""
    def damage(v: bytes) -> bytes:
        b = bytearray(v)
        b[offset_of(v)] ^= 0x04
        return bytes(b)
    return damage


def test_one_pooled_get_many_misses_and_deletes_every_damaged_block_and_serves_the_rest(tmp_path: Path) -> None:
    """Damage in each checked part of a zstd payload -- the header (its shape: the header crc32),
    its binding (the crc too), the coded frame (the coded crc32), the stored frame (zstd's xxh64)
    -- in one get_many on the decode pool: each damaged block is a miss and deleted, the others
    are served bit for bit, into their outs."""
    binding = payload_binding(make_key(0).hash, make_key(0).namespace)
    header_size = Codec().check_header(Codec().encode(make_block(0), binding)).header_size
    damages = {1: _flip_at(lambda v: 9),                       # a dim of the shape
               3: _flip_at(lambda v: header_size - 20),         # the binding's last bytes
               4: _flip_at(lambda v: len(v) - 100),             # the last (coded) frame
               6: _flip_at(lambda v: header_size + 100)}        # the first (stored) frame's data
    with DiskTier(str(tmp_path), CAP) as t:
        for i in range(8):
            t.put(make_key(i), make_block(i))
    for i, damage in damages.items():
        rewrite(tmp_path, "payload", make_key(i).hash, damage)
    with DiskTier(str(tmp_path), CAP, decode_threads=3) as t:
        outs = [torch.zeros(make_block(i).numel(), dtype=make_block(i).dtype) for i in range(8)]
        got = t.get_many([make_key(i) for i in range(8)], outs)
        assert [i for i, g in enumerate(got) if g is None] == sorted(damages)
        for i, g in enumerate(got):
            if g is not None:
                assert same_bits(g, make_block(i)) and g.data_ptr() == outs[i].data_ptr()
        s = t.stats()
        assert (s.store_hits, s.misses, s.corrupt, s.blocks) == (4, 0, 4, 4)
        assert not any(t.contains(make_key(i)) for i in damages)
        assert t.verify().damaged == () and t.check() == []


def test_layout_mismatch_is_corrupt(tmp_path: Path) -> None:
    layout = BlockLayout(num_layers=2, block_size=16, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    with DiskTier(str(tmp_path), CAP) as t:
        t.put(make_key(0), make_block(0))                     # float32
        t.put(make_key(1), make_block(1))                     # float16, the layout's shape
    with DiskTier(str(tmp_path), CAP, layout=layout) as t:
        assert t.get(make_key(0)) is None and t.stats().corrupt == 1 and not t.contains(make_key(0))
        assert same_bits(t.get(make_key(1)), make_block(1))
        with pytest.raises(ValueError, match="shape"):
            t.put(make_key(2), torch.zeros(4, 4, dtype=torch.float16))


def test_delete_removes_stored_and_pending_blocks(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path), CAP) as t:
        t.put(make_key(0), make_block(0))
        t.drain()
        assert t.delete(make_key(0)) and not t.delete(make_key(0))
        t.put(make_key(1), make_block(1))
        assert t.delete(make_key(1))                     # pending or just committed: gone either way
        t.drain()
        assert not t.contains(make_key(0)) and not t.contains(make_key(1))
        assert (t.stats().blocks, t.stats().used_bytes) == (0, 0)
        assert t.check() == []


def test_clear_empties_the_store(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path), CAP) as t:
        for i in range(4):
            t.put(make_key(i), make_block(i))
        t.drain()
        t.put(make_key(4), make_block(4))
        assert t.clear() in (4, 5)                            # 5 if the writer committed block 4 first
        t.drain()
        assert not any(t.contains(make_key(i)) for i in range(5))
        assert (t.stats().blocks, t.stats().used_bytes, t.stats().raw_bytes) == (0, 0, 0)
        t.put(make_key(0), make_block(0))
        t.drain()
        assert same_bits(t.get(make_key(0)), make_block(0)) and t.check() == []


def test_reopened_in_another_process_finds_every_block(tmp_path: Path) -> None:
    p = child("write", tmp_path, CAP, 0, 30)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "done"
    with DiskTier(str(tmp_path), CAP) as t:
        assert t.stats().blocks == 30
        for i in range(30):
            assert same_bits(t.get(make_key(i)), make_block(i)), i
        assert t.check() == []


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path), CAP, batch_blocks=4) as t:
        p = child("share", tmp_path, CAP, 1000, 40, 0)
        try:
            for i in range(40):                   # written while the child writes its own blocks
                t.put(make_key(i), make_block(i))
                if i % 8 == 7:
                    t.drain()
            t.drain()
            assert p.stdout.readline().strip() == "written"
            for i in range(1000, 1040):
                assert same_bits(t.get(make_key(i)), make_block(i)), i
            p.stdin.write("check\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "seen 40"
        finally:
            p.communicate(timeout=60)
        assert p.returncode == 0
        s = t.stats()
        assert s.blocks == 80
        assert s.used_bytes == sum(b.stored_size for b in t.iter_blocks())
        assert t.check() == []


def test_kill_9_during_heavy_writes_leaves_a_sound_store(tmp_path: Path) -> None:
    shape = (4, 2, 16, 4, 32)
    p = child("forever", tmp_path, 256 << 20)
    try:
        committed = 0
        while committed < 64:
            line = p.stdout.readline()
            assert line, "child died"
            committed = int(line.split()[1])
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    with DiskTier(str(tmp_path), 256 << 20) as t:
        assert t.check() == []
        stored = list(t.iter_blocks())
        assert len(stored) >= committed
        found = {b.token_ids[0] // 16 for b in stored}
        assert set(range(committed)) <= found
        for i in found:
            assert same_bits(t.get(make_key(i)), make_block(i, shape=shape)), i
        assert t.verify().damaged == ()


def test_full_map_evicts_and_keeps_writing(tmp_path: Path) -> None:
    shape = (4, 2, 16, 4, 32)                         # 64 KiB of incompressible float32
    with DiskTier(str(tmp_path), CAP, map_size=1 << 20, batch_blocks=8) as t:
        for i in range(60):
            t.put(make_key(i), noise_block(i, shape))
        assert t.drain(timeout=60)
        s = t.stats()
        assert s.write_errors == 0 and s.evictions > 0 and s.blocks < 16
        for i in range(57, 60):
            assert same_bits(t.get(make_key(i)), noise_block(i, shape)), i
        t.put(make_key(100), noise_block(100, (512, 1024)))   # 2 MiB: larger than the whole map
        t.put(make_key(101), noise_block(101, shape))
        assert t.drain(timeout=60) is False               # the truth: block 100 is not on disk
        assert t.stats().write_errors == 1 and not t.contains(make_key(100))
        assert same_bits(t.get(make_key(101)), noise_block(101, shape))
        t.put(make_key(102), noise_block(102, shape))
        assert t.drain(timeout=60) is True                # no loss since the last drain
        assert t.check() == []


def test_verify_finds_damage_and_repair_deletes_it(tmp_path: Path) -> None:
    forged = dataclasses.replace(make_key(9), hash=b"\x42" * 32)   # hash not of (parent, tokens)
    with DiskTier(str(tmp_path), CAP) as t:
        for i in range(5):
            t.put(make_key(i), make_block(i))
        t.put(forged, make_block(9))
    rewrite(tmp_path, "payload", make_key(2).hash, flip_middle_byte)
    with DiskTier(str(tmp_path), CAP, readonly=True) as ro:           # inspection next to no writer
        report = ro.verify()
        assert type(report) is VerifyReport            # the one report the remote's verify answers too
        assert report.checked == 6 and report.repaired == 0
        assert {d.key: d.reason.split(":")[0] for d in report.damaged} == {
            make_key(2).hash: "codec", forged.hash: "hash chain broken"}
        assert sorted(b.token_ids[0] // 16 for b in ro.iter_blocks()) == [0, 1, 2, 3, 4, 9]
        assert same_bits(ro.get(make_key(1)), make_block(1))
        with pytest.raises(RuntimeError, match="readonly"):
            ro.put(make_key(5), make_block(5))
        with pytest.raises(RuntimeError, match="readonly"):
            ro.verify(repair=True)
    with DiskTier(str(tmp_path), CAP) as t:
        assert t.verify(repair=True).repaired == 2
        assert t.verify().damaged == ()
        assert sorted(b.token_ids[0] // 16 for b in t.iter_blocks()) == [0, 1, 3, 4]
        assert t.stats().blocks == 4 and t.check() == []
        infos = {b.hash: b for b in t.iter_blocks()}
        k = make_key(3)
        b = infos[k.hash]
        assert (b.parent, b.namespace, b.token_ids, b.raw_size) == (k.parent, k.namespace, k.token_ids,
                                                                    make_block(3).numel() * 4)


def test_readonly_open_of_a_missing_directory_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        DiskTier(str(tmp_path / "nope"), CAP, readonly=True)
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(str(tmp_path), 0)


def test_drain_since_a_mark_reports_a_block_dropped_before_the_drain_began(tmp_path: Path) -> None:
    """A put the writer drops before drain() starts waiting (here: one that cannot be encoded)
    makes drain(since=mark) False; a plain drain() started after the drop would say True."""
    with DiskTier(str(tmp_path), CAP, encode_process=None) as t:
        mark = t.write_failures()
        t._writer._encoding._codec = None         # the next encode fails: the writer drops the block
        t.put(make_key(1), make_block(1))
        deadline = time.monotonic() + 60
        while t.write_failures() == mark and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.write_failures() == mark + 1
        t._writer._encoding._codec = t.codec
        assert t.drain(timeout=60) is True        # nothing lost while it waited
        assert t.drain(timeout=60, since=mark) is False
        mark = t.write_failures()
        t.put(make_key(2), make_block(2))
        assert t.drain(timeout=60, since=mark) is True
