"""A circuit breaker: stop calling a dependency that keeps failing, try it again later.

Knows: three states and the moves between them --
  closed     every call goes through; `failures_to_open` failures in a row open it
  open       no call goes through (the caller takes its fallback at once: a miss, a dropped
             write) until `cooldown_s` has passed since it opened
  half_open  one call at a time goes through as a probe: a success closes the breaker, a
             failure opens it again for another cooldown (a probe its caller gave up on, with
             no verdict, frees the slot: release())
Doesn't know: what is being called or what a failure is (the caller says: storage/remote/tier.py
counts connection errors and timeouts, not a miss).

Why: a remote store that is down or slow would otherwise cost every lookup its full timeout;
with the breaker open the remote tier costs nothing and the cache behaves as if it had none.

Thread-safe: every method takes one small lock and does no I/O.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_open: int = 3
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.failures_to_open, bool) or not isinstance(self.failures_to_open, int) \
                or self.failures_to_open < 1:
            raise ValueError(f"failures_to_open: expected an int >= 1, got {self.failures_to_open!r}")
        if isinstance(self.cooldown_s, bool) or not isinstance(self.cooldown_s, (int, float)) or not self.cooldown_s > 0:
            raise ValueError(f"cooldown_s: expected seconds > 0, got {self.cooldown_s!r}")


class CircuitBreaker:
    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic,
                 on_close: Callable[[], None] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._on_close = on_close          # called (outside the lock) when it closes after being open
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0                 # in a row, while closed
        self._opened_at = 0.0
        self._probing = False              # half-open: a probe call is out
        self.opened = 0                    # times it opened (for status)

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.config.cooldown_s:
                return HALF_OPEN           # the next allow() will let a probe through
            return self._state

    def allow(self) -> bool:
        """May a call go through now? In half-open, True for one caller (the probe) at a time:
        that caller must report success() or failure()."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.config.cooldown_s:
                    return False
                self._state = HALF_OPEN
            if self._probing:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        closed_now = False
        with self._lock:
            if self._state != CLOSED:
                closed_now = True
            self._state, self._failures, self._probing = CLOSED, 0, False
        if closed_now and self._on_close is not None:
            self._on_close()

    def release(self) -> None:
        """A call that went through ended with no verdict on the dependency (its caller gave it up,
        storage/cancellation.py): nothing changes, except that a half-open breaker's probe slot
        it may have held is free for the next caller."""
        with self._lock:
            if self._state == HALF_OPEN:
                self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._probing = False
            if self._state == CLOSED:
                self._failures += 1
                if self._failures < self.config.failures_to_open:
                    return
            # NOTE: a failed probe (half-open) or the last of `failures_to_open` in a row opens
            # it; each opening restarts the cooldown, so a dead store is tried once per cooldown.
            self._state, self._opened_at, self._failures = OPEN, self._clock(), 0
            self.opened += 1
