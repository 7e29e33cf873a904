"""Admission and worker threads for the engine's blocking generation calls.

Knows: how many generation requests are in flight (at most `max_queue`: more get 429; none
once draining: 503), and how many of them are one tenant's (at most `max_per_tenant`: more get
429 with Retry-After, so one tenant cannot take the whole batch while others wait); and how a
blocking call or a blocking iterator runs off the event loop on the service's own worker pool
-- one thread per admitted request, so a full engine queue never starves the threads that
serve /health, /metrics and the cache routes (those use Starlette's default pool).

A request's admission is released by its worker thread when the engine call has returned,
not when the client goes away: the in-flight count is what the engine is really doing, and
graceful shutdown waits on it. A client that goes away, or a call past its timeout (504), is
abandoned: `call` aborts the engine's request through its AbortHandle (engine/abort.py) and
waits the step or so the engine takes to end it; the route aborts a stream likewise
(service/openai_routes.py).
NOTE: the engine never waits on a consumer. A stream whose client does not read is not
stalled: its chunks queue here (an unbounded queue, holding at most max_tokens + 2 items, the
request's own cap) while the engine goes on; its slot in the batch is held only until
max_tokens, and counts against its tenant's bound meanwhile.
Doesn't know: HTTP routes, response shapes or the engine's types.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from engine.abort import CLIENT_DISCONNECTED, TIMEOUT, AbortHandle
from service.errors import APIError, from_engine_error

T = TypeVar("T")
_ITEM, _ERROR, _END = range(3)
# Seconds an abandoned call's abort may take to end it (a step, then its bill's commit) before
# the route answers without its bill.
ABORT_WAIT_S = 30.0


class Abandoned(Exception):
    """A call given up before it returned: `reason` CLIENT_DISCONNECTED or TIMEOUT; `result`
    what it returned once aborted (None when it did not end within ABORT_WAIT_S)."""

    def __init__(self, reason: str, result: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result


class Dispatcher:
    def __init__(self, max_queue: int, max_per_tenant: int | None = None) -> None:
        self.max_queue = max_queue
        self.max_per_tenant = max_per_tenant if max_per_tenant is not None else max_queue
        self._pool = ThreadPoolExecutor(max_workers=max_queue, thread_name_prefix="tieredkv-request")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._by_tenant: dict[str, int] = {}      # tenants with requests in flight only
        self._draining = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def in_flight_of(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """From now on every generation request gets 503; those in flight run to the end."""
        self._draining = True

    def _admit(self, tenant: str) -> None:
        with self._lock:
            if self._draining:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if self._in_flight >= self.max_queue:
                raise APIError(429, f"the server is busy: {self.max_queue} requests in flight", code="queue_full")
            mine = self._by_tenant.get(tenant, 0)
            if mine >= self.max_per_tenant:
                raise APIError(429, f"tenant {tenant!r} has {mine} requests in flight, the most one tenant may have "
                               "(--max-inflight-per-tenant); retry when one has finished", code="rate_limit_exceeded")
            self._in_flight += 1
            self._by_tenant[tenant] = mine + 1

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._in_flight -= 1
            left = self._by_tenant[tenant] - 1
            if left:
                self._by_tenant[tenant] = left
            else:
                del self._by_tenant[tenant]

    def _submit(self, tenant: str, job: Callable[[], Any]) -> Any:
        """Admit, then hand `job` to a worker that releases the admission when it is done."""
        self._admit(tenant)

        def run() -> Any:
            try:
                return job()
            finally:
                self._release(tenant)
        try:
            return self._pool.submit(run)
        except RuntimeError:          # the pool was shut down: the app is stopping
            self._release(tenant)
            raise APIError(503, "the server is shutting down", code="shutting_down") from None

    async def call(self, fn: Callable[[], T], *, tenant: str, timeout: float | None = None,
                   abort: AbortHandle | None = None, gone: Callable[[], Awaitable[Any]] | None = None) -> T:
        """`fn()` on a worker thread, counted against `tenant`; engine errors become APIErrors.
        With `abort` (the handle fn's engine call holds): when `gone()` (the client's disconnect)
        finishes first, or the call is still running after `timeout` seconds, the request is
        aborted and Abandoned is raised once it ended. Without it, a call past its timeout is a
        504 and runs on."""
        future = asyncio.wrap_future(self._submit(tenant, fn))
        # NOTE: the future is never cancelled (a job cancelled before it starts would never
        # release its admission): waits are shielded or asyncio.wait, which cancels nothing.
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            done, _ = await asyncio.wait({future} | ({watch} if watch is not None else set()), timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watch is not None:
                watch.cancel()
        if future not in done:
            if abort is None:
                raise APIError(504, f"the request took longer than {timeout:g}s", code="timeout")
            reason = CLIENT_DISCONNECTED if watch is not None and watch in done else TIMEOUT
            abort.abort(reason, delivered_tokens=0)       # nothing of it reached the client
            try:
                result = await asyncio.wait_for(asyncio.shield(future), ABORT_WAIT_S)
            except Exception:
                result = None
            raise Abandoned(reason, result)
        try:
            return future.result()
        except Exception as e:
            raise from_engine_error(e) from None

    async def stream(self, make_iter: Callable[[], Iterable[T]], *, tenant: str,
                     timeout: float | None = None) -> "Events[T]":
        """Iterate `make_iter()` on a worker thread, counted against `tenant`; its items come back
        through a queue. The worker drains the iterator to the end even if nobody reads any more
        (the route aborts the engine's request when its client goes: the iterator then ends)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def post(kind: int, item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, item))
            except RuntimeError:      # the event loop is gone (server stopped); keep draining
                pass

        def produce() -> None:
            try:
                for item in make_iter():
                    post(_ITEM, item)
            except BaseException as e:
                post(_ERROR, e)
            finally:
                post(_END, None)

        self._submit(tenant, produce)
        return Events(queue, timeout)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight == 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


class Events(AsyncIterator[T]):
    """The items of a worker's iterator; its exceptions re-raised as APIErrors."""

    def __init__(self, queue: asyncio.Queue, timeout: float | None) -> None:
        self._queue = queue
        self._timeout = timeout
        self._done = False

    def __aiter__(self) -> "Events[T]":
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        try:
            kind, item = await asyncio.wait_for(self._queue.get(), self._timeout)
        except asyncio.TimeoutError:
            self._done = True
            raise APIError(504, f"no output for {self._timeout:g}s", code="timeout") from None
        if kind == _ITEM:
            return item
        self._done = True
        if kind == _ERROR:
            raise from_engine_error(item)
        raise StopAsyncIteration
