"""Issue 7, items 5 and 6: a damaged or foreign LMDB environment never crashes a process, never
comes up silently empty, and never serves a byte: a writer moves it aside and starts fresh (loud
log, stats().recovered); a reader (verify, inspect) refuses with the reason. Real files, damaged
the way a crash, a full disk or a bad sector damages them. Opens of damaged files run in a child
process, so a SIGBUS (what mapping a truncated file gives) fails the test instead of pytest.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from storage.disk.preflight import DamagedEnvironment, check_environment
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits

REPO = Path(__file__).resolve().parents[2]
CAP = 64 << 20
OPEN_AND_READ = """
import sys
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key
readonly = sys.argv[2] == "ro"
try:
    t = DiskTier(sys.argv[1], 64 << 20, readonly=readonly)
except Exception as e:
    print("refused", type(e).__name__, e)
    sys.exit(3)
got = [t.get(make_key(i)) is not None for i in range(40)]
print("opened", sum(got), "recovered" if t.stats().recovered else "as-is")
if not readonly:
    t.put(make_key(99), make_block(99))
t.close()
"""


def populate(path: Path, n: int = 40) -> None:
    with DiskTier(str(path), CAP) as t:
        for i in range(n):
            t.put(make_key(i), make_block(i))


def open_in_child(path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPEN_AND_READ, str(path), mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def truncate(path: Path) -> None:
    data = path / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)


def break_meta(path: Path) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(4096 + 16)
        f.write(b"\x00\x00\x00\x00")          # meta page 1's magic


def break_main_root(path: Path) -> None:
    meta = check_environment(str(path))
    with open(path / "data.mdb", "r+b") as f:
        f.seek(meta.main_root * meta.page_size)
        f.write(b"\x00" * 16)                 # the root page's header: no longer a branch or leaf


@pytest.mark.parametrize("damage", [truncate, break_meta, break_main_root])
def test_a_damaged_environment_is_refused_by_readers_and_moved_aside_by_a_writer(tmp_path: Path, damage) -> None:
    kv = tmp_path / "kv"
    populate(kv)
    damage(kv)
    with pytest.raises(DamagedEnvironment):
        check_environment(str(kv))
    ro = open_in_child(kv, "ro")
    assert ro.returncode == 3 and "refused DamagedEnvironment" in ro.stdout, (ro.returncode, ro.stdout, ro.stderr)
    rw = open_in_child(kv, "rw")
    assert rw.returncode == 0, (rw.returncode, rw.stdout, rw.stderr)
    assert rw.stdout.split() == ["opened", "0", "recovered"]           # nothing served from the damaged one
    assert "moved aside" in rw.stderr
    asides = [p for p in tmp_path.iterdir() if p.name.startswith("kv.damaged-")]
    assert len(asides) == 1 and (asides[0] / "DAMAGED.txt").read_text().startswith("DamagedEnvironment")
    with DiskTier(str(kv), CAP) as t:                                    # the fresh tier works and persists
        assert t.stats().recovered is None and t.stats().blocks == 1
        assert same_bits(t.get(make_key(99)), make_block(99))
        assert t.check() == []


def test_an_older_format_is_moved_aside_not_served(tmp_path: Path) -> None:
    populate(tmp_path / "kv", 3)
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", (1).to_bytes(8, "little"), db=env.open_db(b"info", txn=txn))
    env.close()
    with DiskTier(str(tmp_path / "kv"), CAP) as t:
        assert "format version 1" in t.stats().recovered
        assert t.stats().blocks == 0 and t.get(make_key(0)) is None


def test_an_environment_that_is_not_ours_is_not_taken_over(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    env.close()
    with DiskTier(str(tmp_path / "kv"), CAP) as t:
        assert "none of the disk tier's databases" in t.stats().recovered
    aside = next(p for p in tmp_path.iterdir() if p.name.startswith("kv.damaged-"))
    env = lmdb.open(str(aside), max_dbs=4, readonly=True)
    with env.begin() as txn:                                              # their bytes are kept
        assert txn.get(b"someone") == b"else's data"
    env.close()


def test_a_reader_maps_what_the_writer_grew(tmp_path: Path) -> None:
    # Item 5: a process opening with a smaller map than the file's adopts the file's.
    with DiskTier(str(tmp_path), CAP, map_size=256 << 20) as t:
        t.put(make_key(0), make_block(0))
    with DiskTier(str(tmp_path), CAP, map_size=64 << 20) as t:
        assert t._env.info()["map_size"] == 256 << 20
        assert same_bits(t.get(make_key(0)), make_block(0))


# ---- damaged page pointers (storage/disk/pagewalk.py) -------------------------------------

def _pages(path: Path):
    """(pgno, page bytes, page size) of every branch/leaf page the current snapshot reaches from
    the main database (named databases included): old copies of pages stay in the file."""
    meta = check_environment(str(path))
    data = (path / "data.mdb").read_bytes()
    ps = meta.page_size
    todo = [meta.main_root]
    while todo:
        pgno = todo.pop()
        p = data[pgno * ps:(pgno + 1) * ps]
        flags, = struct.unpack_from("<H", p, 10)
        for off in _nodes(p):
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, off)
            if flags & 0x01:
                todo.append(lo | hi << 16 | nflags << 32)
            elif nflags & 0x02:
                root = struct.unpack_from("<Q", p, off + 8 + ksize + 40)[0]
                if root != 2**64 - 1:          # P_INVALID: an empty named database (one never written)
                    todo.append(root)
        yield pgno, p, ps


def _nodes(p: bytes):
    lower, = struct.unpack_from("<H", p, 12)
    return struct.unpack_from(f"<{(lower - 16) // 2}H", p, 16)


def _patch(path: Path, offset: int, raw: bytes) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(raw)


def overflow_pointer_past_the_end(path: Path) -> None:
    """A leaf node's value pointer (F_BIGDATA) moved far past the file: what one flipped high bit
    of a page number does. LMDB would SIGBUS on the value's first read."""
    for pgno, p, ps in _pages(path):
        if struct.unpack_from("<H", p, 10)[0] & 0x02:
            for off in _nodes(p):
                ksize, = struct.unpack_from("<H", p, off + 6)
                if struct.unpack_from("<H", p, off + 4)[0] & 0x01:
                    _patch(path, pgno * ps + off + 8 + ksize, struct.pack("<Q", 1 << 20))
                    return
    raise AssertionError("no overflow value in the store")


def branch_pointer_past_the_end(path: Path) -> None:
    for pgno, p, ps in _pages(path):
        if struct.unpack_from("<H", p, 10)[0] & 0x01:
            off = _nodes(p)[-1]
            _patch(path, pgno * ps + off + 2, struct.pack("<H", 0x10))     # mn_hi: page += 16 << 16
            return
    raise AssertionError("no branch page in the store")


def node_offset_outside_its_page(path: Path) -> None:
    for pgno, p, ps in _pages(path):
        if struct.unpack_from("<H", p, 10)[0] & 0x02:
            _patch(path, pgno * ps + 16, struct.pack("<H", ps - 2))       # the first node at the page's end
            return


@pytest.mark.parametrize("damage", [overflow_pointer_past_the_end, branch_pointer_past_the_end,
                                    node_offset_outside_its_page])
def test_a_damaged_page_pointer_is_found_before_lmdb_follows_it(tmp_path: Path, damage) -> None:
    """The meta pages are intact, so the preflight passes; the page walk at open finds the bad
    pointer: a reader refuses, a writer moves the store aside -- neither process crashes."""
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:          # big values (overflow pages) and a tree with branches
        for i in range(300):
            t.put(make_key(i), make_block(i, shape=(2, 2, 16, 2, 16) if i % 2 else (1, 2, 4, 1, 4)))
    damage(kv)
    assert check_environment(str(kv)) is not None
    ro = open_in_child(kv, "ro")
    assert ro.returncode == 3 and "refused DamagedEnvironment" in ro.stdout, (ro.returncode, ro.stdout, ro.stderr)
    rw = open_in_child(kv, "rw")
    assert rw.returncode == 0, (rw.returncode, rw.stdout, rw.stderr)
    assert rw.stdout.split() == ["opened", "0", "recovered"]
    assert "moved aside" in rw.stderr


def test_the_page_walk_reads_every_tree_of_a_healthy_store(tmp_path: Path) -> None:
    """No false alarm: a store written, half deleted and rewritten (free pages reused) passes,
    and the walk reaches the named databases' pages, not just the main one's."""
    from storage.disk.pagewalk import check_pages
    kv = tmp_path / "kv"
    with DiskTier(str(kv), CAP) as t:
        for i in range(300):
            t.put(make_key(i), make_block(i, shape=(2, 2, 16, 2, 16)))
        assert t.drain(timeout=60)
        for i in range(0, 300, 2):
            t.delete(make_key(i))
        for i in range(300, 400):
            t.put(make_key(i), make_block(i, shape=(2, 2, 16, 2, 16)))
        assert t.drain(timeout=60)
        walked = check_pages(t._env, t.path)
        leaves = sum(t._env.stat()["leaf_pages"] for _ in [0])
    assert walked > 10 and walked >= leaves
    with DiskTier(str(kv), CAP, readonly=True) as ro:
        assert ro.stats().blocks == 250 and same_bits(ro.get(make_key(399)), make_block(399, shape=(2, 2, 16, 2, 16)))
