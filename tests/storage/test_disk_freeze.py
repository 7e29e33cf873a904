"""Issue 44, item 3: the filesystem under a disk tier frozen (`fsfreeze -f`) while it serves. No
thread but the tier's own waits: the read that meets the freeze first waits it out on its own
thread with the GIL released, the reads after it return misses at once, stats() answers from
memory, puts are refused and counted, the process's other threads run -- and once it thaws the
tier reads and writes again by itself. Real LMDB on a real loop-mounted ext4 (tests/ext4_image.py); skipped where
the image cannot be mounted (not root) or fsfreeze is missing.

NOTE: before the fix the first read transaction waited in the kernel holding the GIL (py-lmdb
begins a read with it held, and LMDB stores into lock.mdb's map): this test's own thread stopped
until the image's guard thawed the filesystem, which it tells apart (`thawed_by_guard`).
"""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits


def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.05)


def in_the_kernel(thread: threading.Thread) -> bool:
    """Whether `thread` sleeps uninterruptibly (`D`: a write fault waiting for the thaw)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "D"
    except (OSError, IndexError):
        return False


def test_a_frozen_filesystem_holds_only_the_disk_tiers_calls_and_the_tier_comes_back(ext4) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    keys = [make_key(i) for i in range(20)]
    with DiskTier(str(ext4.path / "kv"), 32 << 20, map_size=32 << 20, stall_s=0.5) as t:
        for i, k in enumerate(keys):
            t.put(k, make_block(i))
        assert t.drain() is True
        reads: dict[str, list] = {}
        returned = {name: threading.Event() for name in ("first", "second")}

        def reader(name: str) -> None:          # a loader's read
            reads[name] = t.get_many(keys)
            returned[name].set()

        ticks = [0]
        ticking = threading.Event()

        def ticker() -> None:                   # any other thread of the process (the engine, the event loop)
            while not ticking.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        ext4.freeze(guard_s=120)
        try:
            threading.Thread(target=ticker, daemon=True).start()
            # The first read makes the lock file writable on its own thread: it waits out the freeze
            # there, GIL released. (Before the fix: holding the GIL, and nothing below ran.)
            first = threading.Thread(target=reader, args=("first",), daemon=True)
            first.start()
            # Seen from the kernel before anything else asks the tier: stats() hands its own touch to
            # the tier's touch thread, and whichever touch comes first is the one that waits out the
            # freeze (a read behind it takes its miss after the stall bound: not what this test watches).
            until(lambda: ext4.thawed_by_guard.exists() or in_the_kernel(first), "the first read waiting in the kernel")
            until(lambda: ext4.thawed_by_guard.exists() or t.stats().writes_off is not None, "the tier stalled")
            assert not ext4.thawed_by_guard.exists(), "the process stood still until the guard thawed the filesystem"
            s = t.stats()                                                  # from memory
            assert "frozen or hung" in s.writes_off and s.blocks == len(keys), s
            threading.Thread(target=reader, args=("second",), daemon=True).start()
            assert returned["second"].wait(60), "a read while the tier is stalled waited"
            assert reads["second"] == [None] * len(keys)                   # misses, at once
            assert t.contains(keys[3]) is False                            # a miss to the planner too
            before = t.stats().writes_off_drops
            assert t.put(make_key(100), make_block(100), wait=False) is False
            assert t.stats().writes_off_drops == before + 1
            seen = ticks[0]
            until(lambda: ticks[0] > seen + 10, "another thread running")
            assert not returned["first"].is_set()
            assert not ext4.thawed_by_guard.exists()
        finally:
            ticking.set()
            ext4.thaw()
        assert returned["first"].wait(60)
        assert all(same_bits(g, make_block(i)) for i, g in enumerate(reads["first"]))   # waited, then read
        until(lambda: t.stats().writes_off is None, "the tier back after the thaw")
        assert t.contains(keys[3])
        got = t.get_many(keys)
        assert all(same_bits(g, make_block(i)) for i, g in enumerate(got))  # hits from disk again
        since = t.write_failures()
        assert t.put(make_key(200), make_block(200)) is True
        assert t.drain(since=since) is True                                # writes again
        assert same_bits(t.get(make_key(200)), make_block(200))
        assert t.check() == []


def test_a_slow_commit_turns_writes_off_but_not_reads_and_each_stall_is_said_once(tmp_path, caplog) -> None:
    """The stall watch alone (no root needed): a "write" call past the bound stops writes, not
    reads; a "lock" call stops both; each stall is one line when seen and one when it ends."""
    from storage.disk.stall import DiskStalled, StallWatch
    watch = StallWatch(str(tmp_path), stall_s=0.05)
    for kind, reads_too in (("write", False), ("lock", True)):
        release, entered = threading.Event(), threading.Event()

        def call() -> None:
            with watch.op(kind, f"a {kind} call"):
                entered.set()
                release.wait(60)
        th = threading.Thread(target=call)
        th.start()
        entered.wait(60)
        until(lambda: watch.reason() is not None, "the stall seen")
        assert (watch.reason(reads=True) is not None) is reads_too
        with pytest.raises(DiskStalled):
            watch.check()
        release.set()
        th.join(60)
        assert watch.reason() is None and watch.reason(reads=True) is None
    said = [r.getMessage() for r in caplog.records if "disk tier" in r.getMessage()]
    assert len(said) == 4 and watch.stalls == 2, said
    assert "stalled: a write call" in said[0] and "writes are off" in said[0] and "return again" in said[1]
    assert "stalled: a lock call" in said[2] and "reads are misses" in said[2]
