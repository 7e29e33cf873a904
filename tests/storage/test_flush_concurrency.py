"""Issue 8, item 4: a flush or demote never stalls the engine, even while the disk writer cannot
commit at all; and what it writes is bit-identical to the cached blocks.

The stall is real: another process holds LMDB's write lock, so the writer's queue fills and
every put waits. The engine-side calls (allocate, register, release, match, evictions into a
full host tier) must all complete meanwhile.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from storage.config import CacheConfig
from storage.disk.tier import DiskTier
from storage.tiered_cache import TieredKVCache
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import fill, same_bits

HOLD_WRITE_LOCK = ("import lmdb, sys\nenv = lmdb.open(sys.argv[1], max_dbs=4)\ntxn = env.begin(write=True)\n"
                   "print('locked', flush=True)\nsys.stdin.read()\ntxn.abort()\n")


def test_engine_calls_complete_while_a_flush_waits_on_a_stalled_writer(tmp_path: Path) -> None:
    ks = keys(40)
    config = CacheConfig(block_size=TINY.block_size, device_memory=48 * TINY.nbytes, host_memory=4 * TINY.nbytes,
                         disk_dir=str(tmp_path), disk_capacity=64 << 20)
    disk = DiskTier(str(tmp_path), 64 << 20, layout=TINY, queue_blocks=4)
    cache = TieredKVCache(TINY, config, num_pages=48, disk=disk)
    try:
        cache.release(fill(cache, ks[:32]))                       # 32 cached device blocks
        holder = subprocess.Popen([sys.executable, "-c", HOLD_WRITE_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"      # the writer cannot commit now
        flush = threading.Thread(target=lambda: result.update(r=cache.flush()))
        result: dict = {}
        flush.start()
        deadline = time.monotonic() + 30
        while disk.stats().pending_writes < 4:                    # the queue is full: flush waits
            assert time.monotonic() < deadline and flush.is_alive(), "the flush never filled the queue"
            time.sleep(0.001)
        engine_done = threading.Event()

        def engine_steps() -> None:
            # What the engine thread does each step, including evictions that cascade to disk.
            pages = fill(cache, ks[32:40])
            cache.match(ks)
            cache.release(pages)
            pages = cache.allocate(48)                            # evicts every cached page: device ->
            cache.release(pages)                                  # host -> disk, whose queue is full
            engine_done.set()
        engine = threading.Thread(target=engine_steps)
        engine.start()
        engine.join(20)
        stalled = not engine_done.is_set()
        assert flush.is_alive()                                   # still waiting on the writer...
        holder.stdin.close()                                      # let the writer commit
        holder.wait(30)
        flush.join(60)
        engine.join(60)
        assert not stalled, "the engine waited for the flush"
        assert disk.stats().queue_full_drops > 0                  # past twice the bound: dropped, counted
        assert result["r"].written > 0
        disk.drain()
        for info in disk.iter_blocks():                           # what reached disk is exact
            k = next(k for k in ks if k.hash == info.hash)
            assert same_bits(disk.get(k), block_data(k, TINY))
        assert disk.check() == []
        cache.audit()
    finally:
        cache.close()
