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
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from engine.billing import Entry, Ledger
from storage.background_writer import BackgroundWriter

log = logging.getLogger("tieredkv.billing")

Done = Callable[[bool | None, Exception | None], None]   # (recorded, error)


class BillingWriter(BackgroundWriter[list[tuple[Entry, Done]]]):
    def __init__(self, ledger: Ledger, max_group: int = 256) -> None:
        super().__init__("tieredkv-billing")
        self.ledger = ledger
        self.max_group = max_group
        self._queue: deque[tuple[Entry, Done]] = deque()   # guarded by _cond
        self.groups = 0                                     # commits made (for tests and stats)
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

    def _has_work(self) -> bool:
        return bool(self._queue)

    def _take(self) -> list[tuple[Entry, Done]]:
        return [self._queue.popleft() for _ in range(min(self.max_group, len(self._queue)))]

    def _write(self, group: list[tuple[Entry, Done]]) -> bool:
        try:
            outcomes = self.ledger.record_many([e for e, _ in group])
            error = None
        except Exception as e:      # the whole group failed to commit: each request fails
            log.exception("billing: committing %d requests failed", len(group))
            outcomes, error = [None] * len(group), e
        self.groups += 1
        self.entries += len(group)
        for (_, done), recorded in zip(group, outcomes):
            try:
                done(recorded, error)
            except Exception:
                log.exception("billing: a completion callback failed")
        return error is None
