"""The skeleton every background writer shares: work queued by any thread, done by one thread.

Knows: the condition that guards a writer's state, its thread (started, stopped, joined), the
loop -- wait for work or a stop, take a batch under the condition, write it with no lock held,
then record the outcome under the condition and wake every waiter --, and waits with a deadline
(a drain, room in the queue).
Doesn't know: what the work is. A subclass says what is queued and how a batch is taken
(`_has_work`, `_take`, under the condition), writes it (`_write`, no lock held; its answer goes to
`_after`), and may prepare its thread (`_on_start`) and clean up after it (`_on_exit`). The disk
writer (storage/disk/writer.py), the remote writer (storage/remote/writer.py) and the billing
writer (engine/billing_writer.py) are its three.

Look-ahead (a subclass with `_look_ahead = True`: the disk and remote writers): a batch has work
that needs neither the store nor a lock -- encoding -- which `_prepare` starts on a pool and
`_ready` waits for. Once batch k is ready, batch k+1 is taken and prepared, and only then is k
written: k+1 encodes while k commits (or is sent). At most one batch is ever taken ahead, so
memory stays bounded by the queue plus two batches; batches are still written one at a time, in
the order they were taken, each `_after` before the next `_write`.

A subclass may defer the look-ahead batch's preparation (`_defer_prepare`) until its write of
batch k has done its CPU work and only waits on the drive: it calls `start_deferred()` there (the
disk writer: after the transaction's body, before its commit and fsync), so k+1's encodes do not
take the GIL and memory bandwidth from k's body. The loop starts it after the write otherwise.

Group commit (a subclass whose every write pays a fixed price, the disk's fsync, sets
`_linger_gap_s`): woken from idle with a batch not yet full, the writer waits while items keep
arriving -- each at most `_linger_gap_s` after the last, never past `_linger_max_s` in all, until
a batch is full -- so a burst of puts is one write, not a small one first. And once batch k is
written, the look-ahead batch k+1 (taken when k was ready) is topped up (`_top_up`, under the
condition) with what was queued while k was written, its extra work started (`_prepare_more`):
one full write instead of a partial one and another.

Threads: the subclass's queueing methods run on any thread and hold `_cond` only to edit the
queue; `_write` runs on the writer's own thread with no lock held (NOTE: never hold `_cond`
across I/O: every submit and drain would wait for the drive or the network).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Generic, TypeVar

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")


class BackgroundWriter(Generic[Batch]):
    def __init__(self, thread_name: str) -> None:
        self._cond = threading.Condition()      # re-entrant: a test may hold it to line up a batch
        self._stopping = False                  # under _cond
        self._busy = False                      # under _cond: a batch is in hand (being written, or taken ahead)
        self._thread_name = thread_name
        self._thread: threading.Thread | None = None

    # ---- what a subclass says ----------------------------------------------------------------
    def _has_work(self) -> bool:
        """Under _cond: whether anything is queued."""
        raise NotImplementedError

    def _take(self) -> Batch:
        """Under _cond, with work queued: the next batch, taken off the queue."""
        raise NotImplementedError

    def _write(self, batch: Batch) -> bool:
        """On the writer thread, no lock held: write the batch; True when all of it landed. An
        exception is logged and taken as False (the writer never dies of one batch)."""
        raise NotImplementedError

    def _after(self, batch: Batch, ok: bool) -> None:
        """Under _cond, once the batch is written (or failed): record its outcome."""

    _deferred = None     # the look-ahead batch whose preparation the write starts (writer thread only)

    def _defer_prepare(self, batch: Batch) -> bool:
        """Whether the look-ahead batch's preparation waits for the write before it to call
        start_deferred() (its body done, its commit to come): its encodes then contend with the
        commit's wait on the drive, not with the body's CPU and GIL."""
        return False

    def start_deferred(self) -> None:
        """On the writer thread: start the deferred look-ahead batch's preparation (once)."""
        batch, self._deferred = self._deferred, None
        if batch is not None:
            self._prepare(batch)

    def _failed(self, batch: Batch) -> None:
        """On the writer thread, no lock held: an exception escaped the batch's preparation or
        write (a bug: `_write` handles its own failures), so none of it landed -- count the loss."""

    def _on_start(self) -> None:
        """On the writer thread, before its first batch."""

    def _on_exit(self) -> None:
        """On the writer thread, after its last batch (stopping, everything queued written)."""

    # Look-ahead writers take the next batch once the current one is ready, and prepare it while
    # the current one is written (see the module docstring).
    _look_ahead = False

    def _prepare(self, batch: Batch) -> None:
        """On the writer thread, no lock held, as the batch is taken: start the work that needs
        neither the store nor a lock (on a pool; return without waiting for it). Never raises."""

    def _ready(self, batch: Batch) -> None:
        """On the writer thread, no lock held, before `_write`: wait for what `_prepare` started."""

    # Group commit (see the module docstring): off unless a subclass sets the gap.
    _linger_gap_s = 0.0
    _linger_max_s = 0.0

    def _queued(self) -> int:
        """Under _cond: how many items are queued (what the linger counts)."""
        return 0

    def _batch_limit(self) -> int:
        """Under _cond: the most items one batch takes (the linger stops there)."""
        return 1

    def _top_up(self, batch: Batch) -> bool:
        """Under _cond, once the batch before it was written: add what was queued since it was
        taken, up to a full batch. True when it added something (then `_prepare_more` runs)."""
        return False

    def _prepare_more(self, batch: Batch) -> None:
        """On the writer thread, no lock held: start the work of what `_top_up` added. Never raises."""

    def _idle_timeout(self) -> float | None:
        """Under _cond, with nothing to do: how long to sleep before asking _has_work again (a
        retry that comes due); None: until something is queued or the writer stops."""
        return None

    # ---- the thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, let the thread write what is queued, and wait (up to `timeout`) for
        it to exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        self._on_start()
        ahead: Batch | None = None   # look-ahead: the next batch, taken and being prepared
        has_ahead = False
        while True:
            with self._cond:
                if has_ahead:
                    batch, fresh = ahead, False
                else:
                    while not self._has_work() and not self._stopping:
                        self._cond.wait(self._idle_timeout())
                    if not self._has_work():
                        break       # stopping, and everything queued was written
                    self._linger()
                    batch, fresh = self._take(), True
                    self._busy = True
                ahead, has_ahead = None, False
            ok = False
            try:
                if fresh:
                    self._prepare(batch)
                self._ready(batch)
                if self._look_ahead:
                    # NOTE: taken only once this batch is ready (its encodes done), so the next
                    # batch gathers what was queued meanwhile; _busy stays set while it is held.
                    with self._cond:
                        if self._has_work():
                            ahead, has_ahead = self._take(), True
                    if has_ahead:
                        if self._defer_prepare(ahead):
                            self._deferred = ahead      # started by the write, once its body is done
                        else:
                            self._prepare(ahead)
                ok = self._write(batch)
                self.start_deferred()     # (when the write did not: it failed, or wrote nothing)
                if has_ahead:
                    with self._cond:
                        more = self._top_up(ahead)
                    if more:
                        self._prepare_more(ahead)
            except Exception:       # never let the writer die: the process goes on without this write
                log.exception("%s: writing a batch failed", self._thread_name)
                if not ok:
                    self._failed(batch)
            finally:
                self.start_deferred()     # the batch ahead is never left unprepared
                with self._cond:
                    self._busy = has_ahead
                    self._after(batch, ok)
                    self._cond.notify_all()
        self._on_exit()

    def _linger(self) -> None:
        """Under _cond, woken from idle with work: wait while a burst is still arriving (see the
        module docstring). Returns at once with nothing queued (accesses, a probe) or a full batch."""
        if self._linger_gap_s <= 0:
            return
        seen, limit = self._queued(), self._batch_limit()
        deadline = time.monotonic() + self._linger_max_s
        while 0 < seen < limit and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(self._linger_gap_s, left))
            now = self._queued()
            if now <= seen:
                return      # a quiet gap (or the queue shrank: a cancel): the burst is over
            seen = now

    # ---- waits -------------------------------------------------------------------------------
    def _wait_for(self, done: Callable[[], bool], timeout: float | None, needs_thread: bool = False) -> bool:
        """Wait until done() (asked under _cond) holds: True; False once `timeout` passed, or,
        with `needs_thread`, once the writer thread is gone (nothing would ever make it hold)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not done():
                if needs_thread and not self.alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _drained(self) -> bool:
        """Under _cond: nothing queued and nothing being written."""
        return not self._has_work() and not self._busy
