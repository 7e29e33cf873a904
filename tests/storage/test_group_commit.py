"""Group commit in the writers' skeleton (storage/background_writer.py): a burst of puts waits to
fill a batch, the look-ahead batch is topped up with what came while the batch before it was
written, and a batch lost to an exception is counted as lost -- on a writer of the test's own (the
skeleton knows no store), then on the disk tier's writer with real LMDB files, its commits
counted by LMDB's own transaction ids."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from storage.background_writer import BackgroundWriter
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits
from tests.storage.test_disk_tier import CAP, HOLD_WRITE_LOCK

DEADLINE = 60.0     # generous: a busy CI machine; nothing here asserts a duration


class ListWriter(BackgroundWriter[list]):
    """Items queued in a list and 'written' by appending each batch to `written`. With
    `hold_first`, the first write waits for `release_first` (a slow commit)."""

    _look_ahead = True

    def __init__(self, limit: int, gap_s: float = 0.0, most_s: float = 0.0, hold_first: bool = False) -> None:
        super().__init__("test-list-writer")
        self.limit = limit
        self._linger_gap_s, self._linger_max_s = gap_s, most_s
        self.queue: list = []
        self.written: list[list] = []
        self.hold_first = hold_first
        self.first_writing = threading.Event()
        self.release_first = threading.Event()

    def put(self, *items: object) -> None:
        with self._cond:
            self.queue.extend(items)
            self._cond.notify_all()

    def drain(self) -> bool:
        return self._wait_for(self._drained, DEADLINE, needs_thread=True)

    def _has_work(self) -> bool:
        return bool(self.queue)

    def _take(self) -> list:
        batch, self.queue = self.queue[:self.limit], self.queue[self.limit:]
        return batch

    def _queued(self) -> int:
        return len(self.queue)

    def _batch_limit(self) -> int:
        return self.limit

    def _top_up(self, batch: list) -> bool:
        n = min(self.limit - len(batch), len(self.queue))
        if n <= 0:
            return False
        batch.extend(self.queue[:n])
        del self.queue[:n]
        return True

    def _write(self, batch: list) -> bool:
        if self.hold_first and not self.written:
            self.first_writing.set()
            assert self.release_first.wait(DEADLINE)
        self.written.append(list(batch))
        return True


def test_a_burst_waits_to_fill_its_batch() -> None:
    # A gap and a bound far longer than the test: only a full batch ends the linger.
    w = ListWriter(limit=8, gap_s=DEADLINE, most_s=DEADLINE)
    w.start()
    try:
        w.put(0)
        threading.Event().wait(0.2)   # long enough for a writer without a linger to take [0] alone
        for i in range(1, 8):         # this one lingers on one item: it takes none yet
            w.put(i)
        assert w.drain()
        assert w.written == [list(range(8))]
    finally:
        w.stop(DEADLINE)


def test_a_quiet_gap_or_the_bound_ends_the_linger() -> None:
    for gap, most in ((0.05, DEADLINE), (DEADLINE, 0.05)):
        w = ListWriter(limit=8, gap_s=gap, most_s=most)
        w.start()
        try:
            w.put("alone")          # nothing follows: written alone once the gap (or the bound) passes
            assert w.drain()
            assert w.written == [["alone"]]
        finally:
            w.stop(DEADLINE)


def test_without_a_linger_the_writer_takes_what_is_queued() -> None:
    w = ListWriter(limit=8, hold_first=True)
    w.start()
    try:
        w.put(0)
        assert w.first_writing.wait(DEADLINE)   # taken alone: no linger
        w.release_first.set()
        assert w.drain()
        assert w.written == [[0]]
    finally:
        w.stop(DEADLINE)


def test_the_look_ahead_batch_is_topped_up_after_the_write_before_it() -> None:
    w = ListWriter(limit=4, hold_first=True)
    with w._cond:                  # lined up before the writer runs: batch [0..3], look-ahead [4]
        w.put(0, 1, 2, 3, 4)
        w.start()
    try:
        assert w.first_writing.wait(DEADLINE)
        with w._cond:
            assert w.queue == []   # both batches taken
        w.put(5, 6, 7, 8)          # queued while [0..3] is written
        w.release_first.set()
        assert w.drain()
        # [4] topped up to a full batch, not written alone before [5..8]
        assert w.written == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    finally:
        w.stop(DEADLINE)


def _last_txnid(t: DiskTier) -> int:
    return t._gate.env.info()["last_txnid"]


def test_the_disk_writer_tops_up_while_a_commit_waits(tmp_path: Path) -> None:
    """Real LMDB: a batch waits on another process's write lock while more blocks are put; the
    look-ahead batch takes them, so the burst costs two commits, not three, and every block reads back
    bit-identical."""
    t = DiskTier(str(tmp_path), CAP, batch_blocks=4)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WRITE_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _last_txnid(t)
        w = t._writer
        with w._cond:              # lined up: the first batch [0..3], the look-ahead [4]
            for i in range(5):
                t.put(make_key(i), make_block(i))
        tick = threading.Event()
        for _ in range(int(DEADLINE / 0.01)):     # until the writer took both (the first then waits on the lock)
            with w._cond:
                if not w._queue:
                    break
            tick.wait(0.01)
        with w._cond:
            assert not w._queue
        for i in range(5, 8):      # queued while the first batch waits for the lock
            t.put(make_key(i), make_block(i))
        assert not t.drain(timeout=0.2)
    finally:
        holder.stdin.close()
        holder.wait(DEADLINE)
    assert t.drain(timeout=DEADLINE)
    assert _last_txnid(t) - before == 2     # [0..3], [4..7] (topped up) -- not [4] alone, then [5..7]
    for i in range(8):
        assert same_bits(t.get(make_key(i)), make_block(i))
    assert t.stats().blocks == 8 and t.stats().write_errors == 0
    t.close()


def test_a_batch_lost_to_an_exception_is_counted(tmp_path: Path) -> None:
    """An exception out of a batch's encoding (a bug: encode failures of single blocks are
    handled per block) loses the batch; drain() must say so and write_errors count it."""
    t = DiskTier(str(tmp_path), CAP)
    encoding = t._writer._encoding
    real_finish = encoding.finish
    calls = []

    def finish_failing_once(enc):
        calls.append(len(enc.items))
        if len(calls) == 1:
            raise RuntimeError("injected: collecting the batch's encodes failed")
        return real_finish(enc)

    encoding.finish = finish_failing_once
    try:
        t.put(make_key(1), make_block(1))
        assert not t.drain(timeout=DEADLINE)       # lost, and said
        assert t.stats().write_errors == 1 and t.stats().blocks == 0
        assert not t.contains(make_key(1))
        t.put(make_key(2), make_block(2))          # the writer lives on
        assert t.drain(timeout=DEADLINE)
        assert same_bits(t.get(make_key(2)), make_block(2))
    finally:
        t.close()
    assert calls[0] == 1


class DeferringWriter(ListWriter):
    """Defers the look-ahead batch's preparation to its write (as the disk writer does), and
    records the order of events: each write's body, each preparation."""

    def __init__(self, limit: int, start_in_write: bool) -> None:
        super().__init__(limit)
        self.start_in_write = start_in_write
        self.events: list[tuple[str, tuple]] = []

    def _defer_prepare(self, batch: list) -> bool:
        return True

    def _prepare(self, batch: list) -> None:
        self.events.append(("prepare", tuple(batch)))

    def _write(self, batch: list) -> bool:
        self.events.append(("body", tuple(batch)))
        if self.start_in_write:
            self.start_deferred()
        self.events.append(("commit", tuple(batch)))
        return super()._write(batch)


def test_a_deferred_preparation_starts_after_the_body_before_the_commit() -> None:
    for start_in_write in (True, False):
        w = DeferringWriter(limit=2, start_in_write=start_in_write)
        with w._cond:              # lined up: [0, 1] then the look-ahead [2, 3]
            w.put(0, 1, 2, 3)
            w.start()
        try:
            assert w.drain()
        finally:
            w.stop(DEADLINE)
        assert w.written == [[0, 1], [2, 3]]
        first = w.events.index(("body", (0, 1)))
        ahead = w.events.index(("prepare", (2, 3)))
        # Never before the body of the batch written before it; within its write when the write
        # starts it, else right after that write (the loop's own start: never left unprepared).
        assert ahead > first
        assert (ahead < w.events.index(("commit", (0, 1)))) == start_in_write
        assert ahead < w.events.index(("body", (2, 3)))
