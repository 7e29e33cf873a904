"""Issue 41: a disk tier whose filesystem stops taking writes while it serves (a loop-mounted ext4
aborted under it, tests/ext4_image.py) turns its writes off -- one log line, not one per dropped
batch; puts refused and counted, not queued; what it holds still served -- and turns them on
again once its directory can be written (the filesystem mounted again: the store followed).
Real LMDB on real ext4; skipped where the image cannot be mounted (not root).
"""
from __future__ import annotations

import logging
import time

from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits


def until(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_writes_go_off_with_one_line_and_come_back_when_the_filesystem_does(ext4, caplog) -> None:
    caplog.set_level(logging.INFO)
    with DiskTier(str(ext4.path / "kv"), 32 << 20, map_size=32 << 20) as t:
        for i in range(20):
            t.put(make_key(i), make_block(i))
        assert t.drain() is True
        ext4.abort()
        for round_ in range(10):                     # ten batches' worth: one line, not ten
            for i in range(100 + 10 * round_, 110 + 10 * round_):
                t.put(make_key(i), make_block(i))
            t.drain(timeout=60)
        s = t.stats()
        assert s.writes_off and "Read-only file system" in s.writes_off, s
        assert s.writes_off_drops > 0 and s.unavailable is None
        assert same_bits(t.get(make_key(3)), make_block(3))              # still serves what it holds
        said = [r for r in caplog.records if r.levelno >= logging.WARNING and "disk tier" in r.getMessage()]
        assert len(said) == 1 and "writes off" in said[0].getMessage(), [r.getMessage() for r in said]
        assert not [r for r in caplog.records if r.exc_info]
        ext4.recover()
        assert until(lambda: t.stats().writes_off is None), t.stats()
        since = t.write_failures()
        t.put(make_key(500), make_block(500))
        assert t.drain(since=since) is True                             # written, nothing dropped
        assert same_bits(t.get(make_key(500)), make_block(500))
        assert same_bits(t.get(make_key(3)), make_block(3))              # the store as it was committed
    assert [r.getMessage() for r in caplog.records if "writes on" in r.getMessage()]
