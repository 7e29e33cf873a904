"""Billing off the engine thread, with group commit.

Knows: a queue of finished requests' ledger entries, and the one thread that owns the ledger's
write transactions: it takes everything queued, commits it in one transaction (one fsync for
the whole group, however many requests finished meanwhile), then runs each entry's callback
with its outcome. The engine thread only enqueues, so a slow fsync (0.5-10 ms) never delays
another request's next token.
Doesn't know: requests or responses -- a callback decides what the caller sees. The thread, its
loop and the stop are storage/background_writer.py's skeleton.

NOTE invariant (exactly once, committed before the caller sees the result): an entry's callback
runs only after the transaction holding it committed (or failed); the engine completes the
caller's response inside that callback. A crash before the commit loses a request whose caller
never got an answer; a crash after it keeps a request the caller may not have seen, and the
request id keeps a retry from counting it twice.

When the ledger cannot be written (issue 17: a full filesystem), `on_failure` decides:
  "serve" (the default): the request is answered, its entry kept in memory and retried every
    RETRY_S until it commits; the operator sees it (status(): degraded, with the count; /ready
    503; /metrics), and an entry still unwritten when the process closes is spilled to a file
    beside the ledger (or, failing that, logged whole) -- never lost silently. The next open
    commits spilled entries (Ledger._read_spills). A kill -9 while degraded loses what is only
    in memory: that is the price of serving on.
  "refuse": the request fails ("billing failed"), as a ledger that must never lag demands.
Before either, a commit that finds the filesystem full gives the ledger its reserve
(Ledger.release_reserve) and tries again at once.
"""
from __future__ import annotations

import errno
import logging
import time
from collections import deque
from typing import Callable

from engine.billing import Entry, Ledger
from storage.background_writer import BackgroundWriter
from storage.disk.environment import LOW_SPACE_BYTES, free_bytes, is_no_space

log = logging.getLogger("tieredkv.billing")

Done = Callable[[bool | None, Exception | None], None]   # (recorded, error)
ON_FAILURE = ("serve", "refuse")
RETRY_S = 2.0             # how often entries the ledger could not take are tried again


class BillingWriter(BackgroundWriter[list[tuple[Entry, Done | None]]]):
    def __init__(self, ledger: Ledger, max_group: int = 256, on_failure: str = "serve") -> None:
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure: expected one of {ON_FAILURE}, got {on_failure!r}")
        super().__init__("tieredkv-billing")
        self.ledger = ledger
        self.max_group = max_group
        self.on_failure = on_failure
        self._queue: deque[tuple[Entry, Done | None]] = deque()   # guarded by _cond
        # Entries whose commit failed and whose request was answered ("serve"): retried. Under _cond.
        self._unwritten: list[Entry] = []
        self._retry_at = 0.0                  # under _cond: when the next retry is due
        self._final_try = False               # under _cond: stopping, the unwritten were tried once more
        self._failed: list[Entry] = []        # writer thread: the batch just failed, for _after
        self.error: str | None = None         # under _cond: the last failure, while degraded
        self.degraded_since: float | None = None   # under _cond: wall time the ledger first failed
        self._last_logged_error: str | None = None   # writer thread: one log line per distinct failure
        self.spilled = 0                      # entries written to a spill file at close
        self.groups = 0                       # commits made (for tests and stats)
        self.entries = 0
        self.start()

    def submit(self, entry: Entry, done: Done) -> None:
        """Queue one entry; `done(recorded, error)` runs on the billing thread after its commit."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("billing writer is stopped")
            self._queue.append((entry, done))
            self._cond.notify_all()

    def close(self) -> None:
        """Commit everything queued, then stop the thread."""
        self.stop()

    def status(self) -> dict:
        """What the operator sees: "ok", or "degraded" with how many entries wait in memory and why."""
        with self._cond:
            return {"state": "degraded" if self._unwritten else "ok", "on_failure": self.on_failure,
                    "unwritten": len(self._unwritten), "error": self.error if self._unwritten else None,
                    "degraded_since": self.degraded_since if self._unwritten else None,
                    "reserve": self.ledger.reserve_bytes}

    def _has_work(self) -> bool:
        if self._queue:
            return True
        if not self._unwritten:
            return False
        if self._stopping:
            return not self._final_try
        return time.monotonic() >= self._retry_at

    def _idle_timeout(self) -> float | None:
        return max(0.0, self._retry_at - time.monotonic()) if self._unwritten else None

    def _take(self) -> list[tuple[Entry, Done | None]]:
        group: list[tuple[Entry, Done | None]] = []
        if self._unwritten and (self._stopping or time.monotonic() >= self._retry_at):
            group = [(e, None) for e in self._unwritten]     # oldest first: their requests were answered
            self._unwritten = []
            self._final_try = self._stopping
        n = min(self.max_group, len(self._queue))
        return group + [self._queue.popleft() for _ in range(n)]

    def _write(self, group: list[tuple[Entry, Done | None]]) -> bool:
        entries = [e for e, _ in group]
        outcomes, error = self._commit(entries)
        self.groups += 1
        self.entries += len(group)
        serve = error is not None and self.on_failure == "serve"
        self._failed = entries if serve else [e for e, d in group if d is None and error is not None]
        for (_, done), recorded in zip(group, outcomes):
            if done is None:
                continue
            try:
                # "serve": answered now, billed when the ledger takes it (the entry is kept).
                done(recorded, None if serve else error)
            except Exception:
                log.exception("billing: a completion callback failed")
        if error is None:
            self.ledger.restore_reserve()
        return error is None

    def _commit(self, entries: list[Entry]) -> tuple[list[bool | None], Exception | None]:
        if self._stopping and self._final_try and free_bytes(self.ledger.path) < LOW_SPACE_BYTES:
            # Closing on a disk still full: a commit would fail after taking the last pages, which
            # the spill file needs. Straight to the spill.
            return [None] * len(entries), OSError(errno.ENOSPC, "the filesystem is still full at close")
        for attempt in range(2):
            try:
                return self.ledger.record_many(entries), None
            except Exception as e:     # the whole group failed to commit (it is one transaction)
                if attempt == 0 and is_no_space(e, self.ledger.path) and self.ledger.release_reserve():
                    continue           # the reserve is the ledger's room on a full disk: now use it
                if self._last_logged_error != str(e):
                    log.error("billing: committing %d entries failed (%s: %s); %s", len(entries), type(e).__name__, e,
                              "answering and keeping them in memory, retried every %.0f s" % RETRY_S
                              if self.on_failure == "serve" else "their requests fail (--on-billing-failure refuse)")
                    self._last_logged_error = str(e)
                return [None] * len(entries), e
        raise AssertionError("unreachable")

    def _after(self, group: list[tuple[Entry, Done | None]], ok: bool) -> None:
        failed, self._failed = self._failed, []
        if ok:
            if self.degraded_since is not None and not self._unwritten:
                log.warning("billing: the ledger is written again; every entry kept in memory is committed")
                self.degraded_since, self.error, self._last_logged_error = None, None, None
            return
        if not failed:
            return
        if self.degraded_since is None:
            self.degraded_since = time.time()
        self.error = self._last_logged_error
        if self._stopping and self._final_try:
            self._spill(failed)
            return
        self._unwritten = failed + self._unwritten
        self._retry_at = time.monotonic() + RETRY_S

    def _spill(self, entries: list[Entry]) -> None:
        """Closing with entries the ledger never took: to a file the next open commits, or the log."""
        try:
            where = self.ledger.spill(entries)
            self.spilled += len(entries)
            log.error("billing: %d entries could not be committed before closing; written to %s (committed at the "
                      "next start)", len(entries), where)
        except OSError as e:
            log.error("billing: %d entries could not be committed nor spilled (%s); their records follow, to be "
                      "billed by hand", len(entries), e)
            for entry in entries:
                log.error("billing: unwritten %s %s", entry.request_key.decode(), entry.record.decode())
