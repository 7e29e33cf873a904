"""Billing off the engine thread, with group commit.

Knows: a queue of finished requests' ledger entries, and the one thread that owns the ledger's
write transactions: it takes everything queued, commits it in one transaction (one fsync for
the whole group, however many requests finished meanwhile), then runs each entry's callback
with its outcome. The engine thread only enqueues, so a slow fsync (0.5-10 ms) never delays
another request's next token.
Doesn't know: requests or responses -- a callback decides what the caller sees.

NOTE invariant (exactly once, committed before the caller sees the result): an entry's callback
runs only after the transaction holding it committed (or failed); the engine completes the
caller's response inside that callback. A crash before the commit loses a request whose caller
never got an answer; a crash after it keeps a request the caller may not have seen, and the
request id keeps a retry from counting it twice.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from engine.billing import Entry, Ledger

log = logging.getLogger("tieredkv.billing")

Done = Callable[[bool | None, Exception | None], None]   # (recorded, error)


class BillingWriter:
    def __init__(self, ledger: Ledger, max_group: int = 256) -> None:
        self.ledger = ledger
        self.max_group = max_group
        self._cond = threading.Condition()
        self._queue: deque[tuple[Entry, Done]] = deque()   # guarded by _cond
        self._stopping = False
        self.groups = 0                                     # commits made (for tests and stats)
        self.entries = 0
        self._thread = threading.Thread(target=self._loop, name="tieredkv-billing", daemon=True)
        self._thread.start()

    def submit(self, entry: Entry, done: Done) -> None:
        """Queue one entry; `done(recorded, error)` runs on the billing thread after its commit."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("billing writer is stopped")
            self._queue.append((entry, done))
            self._cond.notify()

    def close(self) -> None:
        """Commit everything queued, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                group = [self._queue.popleft() for _ in range(min(self.max_group, len(self._queue)))]
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
