"""Aborting a request whose caller left: the caller's handle, and the engine's queue of aborts.

Knows: `AbortHandle`, what a caller (an HTTP route, a library user) holds to stop its request
from any thread -- before it is submitted, while it waits, loads or runs --, with the reason and
how many completion tokens reached the caller; and `Aborts`, the engine's side: the aborts asked
for, handed to the engine thread at the top of its next step, and the count of aborts by reason.
Doesn't know: the scheduler, pages or billing (engine/engine.py ends an aborted sequence the way
it ends a finished one, with finish_reason "abort", and bills it as engine/output_stream.py says:
the prompt once admitted, the completion tokens delivered).

Threads: `AbortHandle.abort` and `Aborts.request` run on any thread; `Aborts.take` on the engine
thread only. Each holds its own lock for bookkeeping only: the engine's callback runs after the
handle's lock is let go.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

# Why a request was aborted, as the metric's label and the request log say it.
CLIENT_DISCONNECTED = "client_disconnected"     # the HTTP client closed its connection
TIMEOUT = "timeout"                             # the service gave up waiting and answered 504
CALLER_CLOSED = "caller_closed"                 # a library caller closed Engine.stream()'s iterator
ABORT_REASONS = (CLIENT_DISCONNECTED, TIMEOUT, CALLER_CLOSED)

Target = Callable[[str, "int | tuple[int, ...] | None"], None]


def _count(c: object) -> bool:
    return isinstance(c, int) and not isinstance(c, bool) and c >= 0


class AbortHandle:
    """Stops one request: `abort(reason, delivered_tokens)` from any thread, at most once.

    Given to `Engine.generate`/`stream` (`abort=`), it is bound to the request when the engine
    takes it; an abort asked before that takes effect at the binding. `delivered_tokens`: how
    many completion tokens reached the caller (the bill's completion tokens, never more than were
    generated); None: every token generated counts as delivered. A request of n > 1 choices, or
    a batch of prompts, takes one count per choice, indexed prompt_index * n + choice (or one int
    that counts for each choice): engine/request_intake.py."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: Target | None = None
        self._reason: str | None = None
        self._delivered: int | tuple[int, ...] | None = None

    @property
    def reason(self) -> str | None:
        """Why it was aborted; None while it was not."""
        return self._reason

    def abort(self, reason: str, delivered_tokens: int | tuple[int, ...] | list[int] | None = None) -> bool:
        """Ask for the abort; False when one was asked for already (the first one stands)."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason: expected a non-empty string, got {reason!r}")
        counts = delivered_tokens if isinstance(delivered_tokens, (tuple, list)) else (delivered_tokens,)
        if delivered_tokens is not None and not all(_count(c) for c in counts):
            raise ValueError(f"delivered_tokens: expected an int >= 0, a sequence of them (one per choice) or None, "
                             f"got {delivered_tokens!r}")
        if isinstance(delivered_tokens, list):
            delivered_tokens = tuple(delivered_tokens)
        with self._lock:
            if self._reason is not None:
                return False
            self._reason, self._delivered = reason, delivered_tokens
            target = self._target
        if target is not None:
            target(reason, delivered_tokens)
        return True

    def bind(self, target: Target) -> None:
        """The engine took the request: `target(reason, delivered)` ends it (now, if already aborted)."""
        with self._lock:
            if self._target is not None:
                raise ValueError("abort: this AbortHandle already belongs to a request; use one per request")
            self._target = target
            reason, delivered = self._reason, self._delivered
        if reason is not None:
            target(reason, delivered)


class Aborts:
    """The engine's aborts: asked for on any thread, applied on the engine thread, counted by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: list[tuple[object, str, int | tuple[int, ...] | None]] = []
        self._counts: Counter[str] = Counter()

    def request(self, seq: object, reason: str, delivered: int | tuple[int, ...] | None) -> None:
        with self._lock:
            self._asked.append((seq, reason, delivered))

    def take(self) -> list[tuple[object, str, int | tuple[int, ...] | None]]:
        """Every abort asked for since the last call (engine thread)."""
        with self._lock:
            asked, self._asked = self._asked, []
        return asked

    def counted(self, reason: str) -> None:
        """One request really aborted (it had not finished first)."""
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
