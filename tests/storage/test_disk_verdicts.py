"""Issue 17, item 1: every LMDB error is a verdict on the store, never a loop or a dead process.

A page damaged while a process runs (found by a read or by the writer) moves the store aside and
a fresh one serves on; damage the page walk can see at open (an overflow header, a free-page list
naming a live page) is refused before LMDB follows it; counters that disagree with the blocks are
corrected at open and by verify --repair. Real LMDB files, damaged in place with plain writes
(tests/storage/lmdb_pages.py finds the pages). Scenarios that could hang run in a child process
with a deadline, so a hang fails the test instead of stalling the suite.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb

from storage.disk.tier import DiskTier
from tests.storage import lmdb_pages
from tests.storage.disk_tier_child import make_block, make_key, same_bits

REPO = Path(__file__).resolve().parents[2]
CAP = 64 << 20


def run_child(code: str, *args: object) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    return r


LRU_OUT_OF_ORDER = """
import struct, sys
from pathlib import Path
from storage.disk.tier import DiskTier
from tests.storage import lmdb_pages
from tests.storage.disk_tier_child import make_block, make_key, same_bits
path = Path(sys.argv[1])
block = len(make_block(0).numpy().tobytes())
t = DiskTier(str(path), 24 * block, batch_blocks=4)
for i in range(20):
    t.put(make_key(i), make_block(i))
assert t.drain(timeout=60)
# The lru database's lowest key gets the highest sequence: physically first, logically last. LMDB's
# search for it now goes the wrong way (a delete by key finds nothing), a cursor still lands on it.
leaf = next(pg for pg, flags in lmdb_pages.pages(path, "lru") if flags & lmdb_pages.P_LEAF)
p = lmdb_pages.read_page(path, leaf)
off = lmdb_pages.nodes(p)[0]
lmdb_pages.patch(path, leaf * lmdb_pages.page_size(path) + off + 8, b"\\xff")
for i in range(20, 60):            # past the capacity: every commit evicts from the front of the lru
    t.put(make_key(i), make_block(i))
print("flushed", t.drain(timeout=120))
print("served", sum(same_bits(t.get(make_key(i)), make_block(i)) for i in range(50, 60)))
s = t.stats()
print("bound", s.used_bytes <= 24 * block)
t.close()
with DiskTier(str(path), 24 * block) as t:
    print("reopened", t.check(), len(t.verify().damaged))
"""


def test_an_lru_entry_out_of_order_neither_hangs_the_writer_nor_breaks_the_bound(tmp_path: Path) -> None:
    """The hang of issue 17: the writer evicted by key, the damaged entry was never deleted, and
    the same entry came back forever inside one write transaction (drain never returned)."""
    out = run_child(LRU_OUT_OF_ORDER, tmp_path / "kv").stdout.split("\n")
    assert "flushed True" in out and "served 10" in out and "bound True" in out, out
    assert "reopened [] 0" in out, out          # the open rebuilt the LRU index from the blocks


def _break_tree(path: Path, tree: str) -> None:
    """The root page of `tree` marked as an overflow page: LMDB's next search through it is
    MDB_CORRUPTED ("Located page was wrong type")."""
    root, _ = lmdb_pages.pages(path, tree)[0]
    lmdb_pages.patch(path, root * lmdb_pages.page_size(path) + 10, struct.pack("<H", lmdb_pages.P_OVERFLOW))


def _damaged_while_running(tmp_path: Path, first: str) -> None:
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        for i in range(30):
            t.put(make_key(i), make_block(i))
        assert t.drain(timeout=60)
        _break_tree(kv, "meta")
        if first == "read":
            assert t.get(make_key(3)) is None                       # a miss, not an exception
        for i in range(100, 110):
            t.put(make_key(i), make_block(i))
        assert t.drain(timeout=60) is True                           # the batch went to the fresh store
        s = t.stats()
        assert s.moved_aside == 1 and "moved aside to" in s.recovered and s.unavailable is None
        assert all(same_bits(t.get(make_key(i)), make_block(i)) for i in range(100, 110))
        assert t.get(make_key(3)) is None and not t.contains(make_key(3))
        assert t.check() == [] and t.verify().damaged == ()
    aside = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and "CorruptedError" in (aside[0] / "DAMAGED.txt").read_text()
    with DiskTier(str(kv), CAP) as t:                                # the fresh store persists
        assert t.stats().blocks == 10 and same_bits(t.get(make_key(105)), make_block(105))


def test_damage_found_by_a_read_moves_the_store_aside_and_serving_goes_on(tmp_path: Path) -> None:
    _damaged_while_running(tmp_path, "read")


def test_damage_found_by_the_writer_moves_the_store_aside_and_its_batch_lands_in_the_fresh_one(tmp_path: Path) -> None:
    _damaged_while_running(tmp_path, "write")


def _store_with_free_pages(kv: Path) -> None:
    with DiskTier(str(kv), CAP) as t:
        for i in range(200):
            t.put(make_key(i), make_block(i, shape=(2, 2, 16, 2, 16)))
        assert t.drain(timeout=60)
        for i in range(0, 200, 2):
            t.delete(make_key(i))


def _free_list_names(kv: Path, live: int) -> None:
    """Point the first entry of the free-page database's first list at page `live`."""
    for pgno, flags in lmdb_pages.pages(kv, "free"):
        p = lmdb_pages.read_page(kv, pgno)
        if flags & lmdb_pages.P_LEAF:
            for off in lmdb_pages.nodes(p):
                nflags, ksize = struct.unpack_from("<HH", p, off + 4)
                data = off + 8 + ksize
                if nflags & lmdb_pages.F_BIGDATA:
                    data = struct.unpack_from("<Q", p, data)[0] * lmdb_pages.page_size(kv) + 16
                else:
                    data += pgno * lmdb_pages.page_size(kv)
                lmdb_pages.patch(kv, data + 8, struct.pack("<Q", live))
                return
    raise AssertionError("the free-page database is empty")


def _overflow_header(kv: Path) -> None:
    first = lmdb_pages.overflow_runs(kv, "payload")[5]
    lmdb_pages.patch(kv, first * lmdb_pages.page_size(kv) + 12, struct.pack("<I", 77))   # its page count


OPEN = """
import sys
from storage.disk.tier import DiskTier
try:
    t = DiskTier(sys.argv[1], 64 << 20, readonly=sys.argv[2] == "ro")
except Exception as e:
    print("refused", type(e).__name__, e)
    sys.exit(0)
print("opened", t.stats().blocks, "recovered" if t.stats().recovered else "as-is")
t.close()
"""


def test_a_free_page_list_naming_a_live_page_is_refused_before_lmdb_hands_it_out(tmp_path: Path) -> None:
    """LMDB would give the listed page to its next writer, overwriting a live tree page: every
    later commit 'Located page was wrong type' (issue 17: stores that never opened again)."""
    kv = tmp_path / "kv"
    _store_with_free_pages(kv)
    live, _ = lmdb_pages.pages(kv, "meta")[0]
    _free_list_names(kv, live)
    ro = run_child(OPEN, kv, "ro").stdout
    assert ro.startswith("refused DamagedEnvironment") and "still uses" in ro, ro
    rw = run_child(OPEN, kv, "rw").stdout
    assert rw.split() == ["opened", "0", "recovered"], rw


def test_a_damaged_overflow_header_is_refused_and_verify_reports_it(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    _store_with_free_pages(kv)
    _overflow_header(kv)
    ro = run_child(OPEN, kv, "ro").stdout
    assert ro.startswith("refused DamagedEnvironment") and "overflow header" in ro, ro
    r = subprocess.run([sys.executable, "-m", "tieredkv.cli", "verify", "--cache-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 1 and "overflow header" in r.stdout + r.stderr, (r.stdout, r.stderr)


WRONG_COUNTERS = """
import struct, sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 30)
info = env.open_db(b"info")
with env.begin(write=True) as txn:
    used, blocks, raw, seq = struct.unpack("<QQQQ", txn.get(b"counters", db=info))
    txn.put(b"counters", struct.pack("<QQQQ", used + (2 << 20), blocks + 100, raw, seq), db=info)
env.close()
"""


def test_counters_that_disagree_with_the_blocks_are_corrected_at_open_and_by_verify_repair(tmp_path: Path) -> None:
    """Wrong `info` counters held stores 1.5-2.1 MB over a 1 MiB capacity (issue 17)."""
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        for i in range(20):
            t.put(make_key(i), make_block(i))
        assert t.drain(timeout=60)
        right = t.stats()
        run_child(WRONG_COUNTERS, kv)                  # another process writes wrong counters
        report = t.verify()
        assert any("blocks: counted 20, recorded 120" in p for p in report.store), report.store
        fixed = t.verify(repair=True)
        assert fixed.store_repaired and t.check() == [] and t.stats().blocks == right.blocks
    run_child(WRONG_COUNTERS, kv)
    with DiskTier(str(kv), CAP) as t:                  # the open corrects them too
        s = t.stats()
        assert (s.blocks, s.used_bytes) == (right.blocks, right.used_bytes) and t.check() == []


def test_a_full_filesystem_at_open_is_an_unavailable_tier_not_a_sigbus(tmpfs) -> None:
    """LMDB writes lock.mdb through a map: created on a full filesystem, that was a SIGBUS at
    start (issue 17). The lock file is allocated first, so a full filesystem is DiskUnavailable."""
    mnt = tmpfs("1m")
    with open(mnt / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    out = run_child(OPEN, mnt / "kv", "rw").stdout
    assert out.startswith("refused DiskUnavailable") and "full" in out, out


def test_lmdb_reports_the_damage_we_turn_into_a_verdict(tmp_path: Path) -> None:
    """The premise of the read/write tests above: the damaged root is MDB_CORRUPTED to LMDB."""
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        t.put(make_key(1), make_block(1))
    _break_tree(kv, "meta")
    env = lmdb.open(str(kv), max_dbs=4, map_size=1 << 30)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            try:
                txn.get(make_key(1).hash, db=meta)
            except lmdb.CorruptedError:
                return
        raise AssertionError("LMDB read through a page of the wrong type")
    finally:
        env.close()


WRITE_FRESH = """
import sys
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key
with DiskTier(sys.argv[1], 64 << 20) as t:
    for i in range(200, 205):
        t.put(make_key(i), make_block(i))
"""


def test_a_process_sharing_the_directory_follows_a_store_another_one_moved_aside(tmp_path: Path) -> None:
    """Process B moved a damaged store aside and started a fresh one: process A, still mapping the
    old file, takes the fresh one at its writer's next tick instead of writing into the old one."""
    from storage.disk.preflight import move_aside
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        for i in range(10):
            t.put(make_key(i), make_block(i))
        assert t.drain(timeout=60)
        move_aside(str(kv), "moved by another process (test)")
        run_child(WRITE_FRESH, kv)
        t._writer.clear_stale_readers(force=True)        # the writer's periodic tick
        assert t.get(make_key(3)) is None and same_bits(t.get(make_key(202)), make_block(202))
        t.put(make_key(300), make_block(300))
        assert t.drain(timeout=60)
    with DiskTier(str(kv), CAP) as t:
        assert t.stats().blocks == 6 and same_bits(t.get(make_key(300)), make_block(300))


def test_a_disk_that_keeps_damaging_its_stores_is_turned_off_not_replaced_forever(tmp_path: Path) -> None:
    """Each replacement abandons a damaged environment (its map and file descriptor); past
    MAX_REPLACEMENTS in one process the tier is off, reads miss and status says why."""
    from storage.disk.tier import MAX_REPLACEMENTS
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        for round_ in range(MAX_REPLACEMENTS + 1):
            t.put(make_key(round_), make_block(round_))
            assert t.drain(timeout=60)
            _break_tree(kv, "meta")
            assert t.get(make_key(round_)) is None                   # found damaged: a miss
        s = t.stats()
        assert s.moved_aside == MAX_REPLACEMENTS and "tier is off" in s.unavailable
        assert t.get(make_key(0)) is None and t.stats().read_errors >= 1
        mark = t.write_failures()
        t.put(make_key(99), make_block(99))                            # no exception: the write is dropped
        assert t.drain(timeout=60, since=mark) is False
