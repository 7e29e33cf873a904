"""Every call the remote tier makes to its store, through the circuit breaker, on one client
built at the first call.

Knows: the call's verdict for the breaker (a connection error or timeout is a failure, a refusal
-- ResponseError, the store answered -- a success, a cancelled read no verdict but its half-open
slot freed), what it counts (skipped, cancelled, errors), the last error and its log line (one per
10 s), and building and closing the client. Doesn't know: what a call sends or what its answer
means (storage/remote/tier.py), the breaker's states (storage/remote/breaker.py), or how a client
is made (storage/remote/client.py).

Threads: called from any thread (loader threads read, the remote writer's thread writes); the
client is built under its own lock, and the last error is written under the tier's counter lock
(shared: stats() reads the counters and the last error at once), held for no I/O.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from storage.cancellation import Cancelled
from storage.remote.breaker import CircuitBreaker
from storage.remote.client import is_unavailable, make_client
from storage.remote.url import RemoteURL

log = logging.getLogger("storage.remote.tier")   # logged as the tier's, as before this module was split off

_LOG_EVERY_S = 10.0


class GuardedCalls:
    """fn(client) through `breaker`, counted with `count` (the tier's counters). Thread-safe."""

    def __init__(self, url: RemoteURL, timeout_s: float, breaker: CircuitBreaker, count: Callable[..., None],
                 lock: threading.Lock) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.breaker = breaker
        self._count = count
        self._lock = lock                        # the tier's counter lock: guards last_error, _last_log
        self.last_error: str | None = None
        self._last_log = -1e9
        self._client_obj = None
        self._client_lock = threading.Lock()     # building the client (RedisCluster connects)

    def call(self, what: str, fn) -> tuple[str, object]:
        """fn(client) through the breaker: ("ok", its result), or ("skipped" | "failed" |
        "cancelled", None) (counted; a failure logged)."""
        if not self.breaker.allow():
            self._count(skipped=1)
            return "skipped", None
        try:
            out = fn(self.client())
        except Cancelled:
            # The caller gave up (storage/cancellation.py), not the store: no verdict here (the
            # load's outcome tells the breaker when it was too slow: storage/load_outcome.py),
            # but a half-open breaker's probe slot this call held is free again.
            self.breaker.release()
            self._count(cancelled=1)
            return "cancelled", None
        except Exception as e:   # noqa: BLE001 -- any failure of the store is a miss, never a failed request
            from redis.exceptions import ResponseError
            if isinstance(e, ResponseError) and not is_unavailable(e):
                self.breaker.success()       # it answered: a refusal is not an outage
            else:
                self.breaker.failure()
                self._count(errors=1)
            self.note_error(what, e)
            return "failed", None
        self.breaker.success()
        return "ok", out

    def client(self):
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = self._build_client()
            return self._client_obj

    def _build_client(self):
        return make_client(self.url, self.timeout_s)

    def note_error(self, what: str, e: BaseException) -> None:
        msg = f"{what}: {type(e).__name__}: {e}"
        now = time.monotonic()
        with self._lock:
            self.last_error = msg
            if now - self._last_log < _LOG_EVERY_S:
                return           # one line per 10 s: a dead store is called on every lookup
            self._last_log = now
        log.warning("remote tier %s: %s (a miss; breaker %s)", self.url.redacted, msg, self.breaker.state)

    def close(self) -> None:
        """Close the client (the next call builds another)."""
        with self._client_lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
