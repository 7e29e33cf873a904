"""Issue 7, item 3: a dead process's reader slot, on real LMDB files and real processes.
(Item 4, drain() after a dropped write, is in test_disk_tier.py's full-map test.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits

REPO = Path(__file__).resolve().parents[2]

SHAPE = (2, 2, 16, 4, 16)            # 16 KiB of fp32 per block
# Opens the environment, starts a read transaction (a reader slot with this pid) and waits to be killed.
HOLD_READER = ("import lmdb, sys\nenv = lmdb.open(sys.argv[1], max_dbs=4, readonly=True, lock=True)\n"
               "txn = env.begin()\nprint('reading', flush=True)\nsys.stdin.read()\n")


def kill_9_a_reader(path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", HOLD_READER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "reading"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_a_killed_readers_slot_is_cleared_and_no_write_is_lost(tmp_path: Path) -> None:
    block_bytes = make_block(0, shape=SHAPE).numel() * 4
    capacity = 64 * block_bytes                                   # 1 MiB of blocks
    with DiskTier(str(tmp_path), capacity, map_size=8 << 20, batch_blocks=8) as t:
        for i in range(32):
            t.put(make_key(i), make_block(i, shape=SHAPE))
        assert t.drain()
        kill_9_a_reader(tmp_path)                                 # its slot pins this snapshot
        for i in range(32, 32 + 1200):                            # ~19 MiB through an 8 MiB map
            t.put(make_key(i), make_block(i, shape=SHAPE))
        assert t.drain() is True
        s = t.stats()
        assert s.write_errors == 0 and s.evictions > 0 and s.used_bytes <= capacity
        assert t.check() == []
    assert os.path.getsize(tmp_path / "data.mdb") <= 8 << 20



def run_child(*args: object) -> str:
    r = subprocess.run([sys.executable, "-m", "tests.storage.disk_tier_child", *map(str, args)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_process_that_grows_the_map_does_not_break_another(tmp_path: Path) -> None:
    # Item 5: the other process used to die of MapResizedError at its next transaction.
    with DiskTier(str(tmp_path), 64 << 20, map_size=8 << 20) as t:   # this process maps 8 MiB
        t.put(make_key(0), make_block(0))
        assert t.drain()
        run_child("write", tmp_path, 64 << 20, 1, 2000)               # maps 1 GiB and writes ~12 MiB past ours
        assert os.path.getsize(tmp_path / "data.mdb") > 8 << 20
        assert same_bits(t.get(make_key(1999)), make_block(1999))     # adopted, not an error
        t.put(make_key(50), make_block(50))
        assert t.drain() is True
        s = t.stats()
        assert (s.read_errors, s.write_errors) == (0, 0)
        assert t._env.info()["map_size"] == 1 << 30
        assert t.check() == []


def test_capacity_lives_in_the_store_and_a_change_is_loud_and_enforced_by_all(tmp_path: Path) -> None:
    block = make_block(0).numel() * 4
    with DiskTier(str(tmp_path), 64 << 20) as t:
        for i in range(30):
            t.put(make_key(i), make_block(i))
        assert t.drain() and t.stats().blocks == 30
        stderr = run_child("write", tmp_path, 10 * block, 100, 1)     # another process, a smaller capacity
        assert "capacity changed from" in stderr
        s = t.stats()
        assert s.capacity_bytes == 10 * block and s.used_bytes <= 10 * block
        t.put(make_key(200), make_block(200))                          # this process enforces the store's bound
        assert t.drain()
        assert t.stats().used_bytes <= 10 * block and t.check() == []


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A real 4 MiB tmpfs (needs root, as on our machines and CI)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_filesystem_evicts_instead_of_dropping(small_filesystem: Path) -> None:
    # LMDB reports a full tmpfs as EIO from a short write at commit: the old writer dropped the
    # whole batch (and drain() said True). ~9 MiB of blocks into 4 MiB with a 64 MiB capacity.
    # The tier leaves 256 KiB of the filesystem free (its reserve), whatever its capacity says.
    from storage.disk.environment import free_bytes
    with DiskTier(str(small_filesystem / "kv"), 64 << 20, map_size=64 << 20, reserve_bytes=256 << 10) as t:
        for i in range(1500):
            t.put(make_key(i), make_block(i))
        assert t.drain() is True
        s = t.stats()
        assert s.write_errors == 0 and s.evictions > 0
        assert same_bits(t.get(make_key(1499)), make_block(1499))
        assert free_bytes(str(small_filesystem)) >= (256 << 10) - (64 << 10), free_bytes(str(small_filesystem))
        assert s.space_bound_bytes is not None and s.free_bytes is not None
    with DiskTier(str(small_filesystem / "kv"), 64 << 20, map_size=64 << 20, reserve_bytes=1 << 20) as t:
        assert t.check() == [] and t.verify().damaged == ()


class CountingEnv:
    """The tier's LMDB environment, counting the transactions begun through it."""

    def __init__(self, env) -> None:
        self._env, self.begins = env, 0

    def begin(self, *a, **kw):
        self.begins += 1
        return self._env.begin(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_contains_reads_no_lmdb_and_follows_commits_evictions_and_deletes(tmp_path: Path) -> None:
    # Issue 8, item 1: match() asks contains() for every block of every waiting request on
    # every engine step; it is answered from memory (storage/disk/index.py).
    from storage.codec.payload import Codec
    from storage.codec.stored_block import payload_binding
    size = {i: len(Codec().encode(make_block(i), payload_binding(make_key(i).hash, make_key(i).namespace)))
            for i in (0, 1, 2, 3, 4, 10)}                          # stored bytes of each block
    capacity = sum(size[i] for i in range(4))
    with DiskTier(str(tmp_path), capacity) as t:
        for i in range(4):
            t.put(make_key(i), make_block(i))
        assert t.drain()
    with DiskTier(str(tmp_path), capacity) as t:                   # loaded at open
        counting = CountingEnv(t._gate._env)
        t._gate._env = counting                                    # every transaction of the tier begins here
        assert [t.contains(make_key(i)) for i in range(5)] == [True] * 4 + [False]
        assert counting.begins == 0
        t.put(make_key(4), make_block(4))                          # evicts block 0 (LRU)
        assert t.drain()
        assert [t.contains(make_key(i)) for i in range(5)] == [False] + [True] * 4
        assert t.delete(make_key(2)) and not t.contains(make_key(2))
        run_child("write", tmp_path, size[3] + size[4] + size[10], 10, 1)   # another process: stores 10, evicts 1
        assert t.contains(make_key(1))                          # not known here yet...
        assert t.get(make_key(1)) is None                            # ...the read finds it gone: a miss
        assert not t.contains(make_key(1))                      # and forgets it
        assert not t.contains(make_key(10))                     # another's block: a missed hit only
        assert same_bits(t.get(make_key(10)), make_block(10))        # still served if asked for


def test_a_batch_larger_than_the_store_leaves_the_index_exact(tmp_path: Path) -> None:
    # One commit stores 4 blocks into room for 3 and evicts its own first block in the same
    # transaction: the index must say it is gone (found by the state-machine test: the block was
    # matched on disk, then missed).
    from storage.codec.payload import Codec
    from storage.codec.stored_block import payload_binding
    size = [len(Codec().encode(make_block(i), payload_binding(make_key(i).hash, make_key(i).namespace)))
            for i in range(4)]
    with DiskTier(str(tmp_path), sum(size[1:]), batch_blocks=8) as t:
        with t._writer._cond:            # (re-entrant) the writer cannot take a batch until all four are queued
            for i in range(4):
                t.put(make_key(i), make_block(i))
        assert t.drain()
        on_disk = {b.hash for b in t.iter_blocks()}
        assert [t.contains(make_key(i)) for i in range(4)] == [make_key(i).hash in on_disk for i in range(4)]
        assert len(on_disk) == 3
