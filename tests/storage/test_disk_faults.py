"""Issue 7, item 3: a dead process's reader slot, on real LMDB files and real processes.
(Item 4, flush() after a dropped write, is in test_disk_tier.py's full-map test.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from storage.disk_tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key

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
        assert t.flush()
        kill_9_a_reader(tmp_path)                                 # its slot pins this snapshot
        for i in range(32, 32 + 1200):                            # ~19 MiB through an 8 MiB map
            t.put(make_key(i), make_block(i, shape=SHAPE))
        assert t.flush() is True
        s = t.stats()
        assert s.write_errors == 0 and s.evictions > 0 and s.used_bytes <= capacity
        assert t.check() == []
    assert os.path.getsize(tmp_path / "data.mdb") <= 8 << 20

