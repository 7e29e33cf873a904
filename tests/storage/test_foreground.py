"""Issue 28, item 9: background work yields to decoding (storage/foreground.py).

While the foreground signal is set (an engine has running sequences) the write path's encode
pools work one block at a time; cleared, they are as wide as before. Counted with events on real
thread pools, a real DiskTier (real LMDB, the real codec under a gate) and the real RemoteWriter;
no clock. And the pools' threads run at the background niceness (read from /proc).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from storage.codec.payload import Codec
from storage.disk.tier import DiskTier
from storage.foreground import FOREGROUND, Foreground, PoolWidth
from storage.pool_drain import drain_on
from storage.priority import BACKGROUND_NICE
from storage.remote.writer import RemoteWriter, WriteItem
from tests.storage.conftest import block_data, keys
from tests.storage.test_tiered_cache import same_bits

HANG_GUARD_S = 60.0


def wait_until(cond, what: str) -> None:
    """Poll `cond` (a hang guard only: no test here asserts a duration)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.002)


class Gate:
    """Counts the callers inside `enter` and holds each there until `open` is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.done = 0
        self.open = threading.Event()

    def enter(self) -> None:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            assert self.open.wait(HANG_GUARD_S)
        finally:
            with self.lock:
                self.inside -= 1
                self.done += 1

    def now(self) -> int:
        with self.lock:
            return self.inside


@pytest.fixture
def foreground_owner():
    """Holds the process's signal as an engine would; always released after the test."""
    owner = object()
    yield owner
    FOREGROUND.hold(owner, False)


def check_width_follows_the_signal(fg: Foreground, owner: object, width: PoolWidth, gate: Gate, n: int) -> None:
    """With the signal set and `n` items on 3 tasks: one inside, the other two waiting their turn;
    cleared: all three inside at once. Every item done by the end (the gate opened)."""
    wait_until(lambda: gate.now() == 1 and width.waiting() == 2, "one item working, two tasks waiting")
    assert gate.now() == 1 and width.working() == 1
    fg.hold(owner, False)                       # the engine's last sequence finished
    wait_until(lambda: gate.now() == 3, "three items at once once the signal cleared")
    assert width.working() == 3
    fg.hold(owner, True)                        # running again: the width drops at the next item
    gate.open.set()


def test_a_pool_works_one_item_at_a_time_while_the_signal_is_set_and_full_width_when_cleared() -> None:
    fg, owner, gate = Foreground(), object(), Gate()
    width = PoolWidth(3, foreground=fg)
    fg.hold(owner, True)
    assert fg.active() and width.limit() == 1
    with ThreadPoolExecutor(3) as pool:
        futures = drain_on(pool, 3, range(9), lambda j: gate.enter(), width)
        check_width_follows_the_signal(fg, owner, width, gate, 9)
        for f in futures:
            f.result(HANG_GUARD_S)
    assert gate.done == 9 and width.working() == 0 and width.waiting() == 0
    fg.hold(owner, False)
    assert not fg.active() and width.limit() == 3


def test_the_signal_is_held_while_any_owner_holds_it() -> None:
    fg, a, b = Foreground(), object(), object()
    fg.hold(a, True)
    fg.hold(b, True)
    fg.hold(a, True)          # idempotent
    fg.hold(a, False)
    assert fg.active()        # b still runs sequences
    fg.hold(b, False)
    assert not fg.active()


class GatedCodec(Codec):
    """The real codec; each encode first waits at a gate (counts how many encode at once)."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        object.__setattr__(self, "gate", gate)

    def encode(self, block: torch.Tensor, binding: bytes) -> bytes:
        self.gate.enter()
        return super().encode(block, binding)


def test_the_disk_writer_encodes_one_block_at_a_time_while_sequences_run(tmp_path: Path, foreground_owner) -> None:
    gate = Gate()
    ks = keys(9)
    FOREGROUND.hold(foreground_owner, True)
    with DiskTier(str(tmp_path), 64 << 20, GatedCodec(gate), batch_blocks=9, encode_threads=3,
                  encode_process=None) as t:      # the pool's width (the process's: test_encode_process.py)
        with t._writer._cond:           # (re-entrant) the writer takes the nine as one batch
            for k in ks:
                assert t.put(k, block_data(k))
        check_width_follows_the_signal(FOREGROUND, foreground_owner, t._writer.encode_width, gate, 9)
        assert t.drain(timeout=HANG_GUARD_S)
        FOREGROUND.hold(foreground_owner, False)
        assert t.stats().blocks == 9 and t.stats().write_errors == 0
        assert all(same_bits(t.get(k), block_data(k)) for k in ks)
    assert gate.most == 3


def test_the_remote_writer_encodes_one_block_at_a_time_while_sequences_run(foreground_owner) -> None:
    gate, sent = Gate(), []

    def encode(item: WriteItem) -> None:
        gate.enter()
        item.value = b"v" + item.key.hash

    def send(items: list[WriteItem]) -> bool:
        sent.extend(it.value for it in items)
        return True
    FOREGROUND.hold(foreground_owner, True)
    w = RemoteWriter(send, lambda **_: None, batch_blocks=9, encode=encode, encode_threads=3)
    w.start()
    try:
        ks = keys(9)
        with w._cond:                   # (re-entrant) the writer takes the nine as one batch
            for k in ks:
                assert w.submit(WriteItem(k, block=torch.zeros(4)))
        check_width_follows_the_signal(FOREGROUND, foreground_owner, w.encode_width, gate, 9)
        assert w.drain(HANG_GUARD_S)
    finally:
        w.stop()
    assert sorted(sent) == sorted(b"v" + k.hash for k in ks)


def thread_nice(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[16])    # field 19 of proc(5): nice


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: a thread's niceness is its own")
def test_the_encode_pool_threads_run_at_the_background_niceness(tmp_path: Path) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= BACKGROUND_NICE:
        pytest.skip(f"this process already runs at nice {base}")
    ks = keys(12)
    with DiskTier(str(tmp_path), 64 << 20, batch_blocks=4, encode_threads=3, encode_process=None) as t:
        for k in ks:
            assert t.put(k, block_data(k))
        assert t.drain(timeout=HANG_GUARD_S)
        pool = [th for th in threading.enumerate() if th.name.startswith("tieredkv-disk-encode")]
        assert pool, "the writer encoded on no pool"
        assert {thread_nice(th.native_id) for th in pool} == {BACKGROUND_NICE}
    assert thread_nice(threading.get_native_id()) == base       # the caller's own is untouched
