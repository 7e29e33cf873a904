"""Admission and worker threads for the engine's blocking generation calls.

Knows: how many generation requests are in flight (at most `max_queue`: more get 429; none
once draining: 503), and how a blocking call or a blocking iterator runs off the event loop
on the service's own worker pool -- one thread per admitted request, so a full engine queue
never starves the threads that serve /health, /metrics and the cache routes (those use
Starlette's default pool).

A request's admission is released by its worker thread when the engine call has returned,
not when the client goes away: the in-flight count is what the engine is really doing, and
graceful shutdown waits on it. So a client that disconnects mid-stream or times out (504)
does not cancel its request: the engine finishes it, and it is billed like any other (the
tokens were computed). This is a choice -- the engine's API has no cancel -- bounded by the
request's max_tokens.
Doesn't know: HTTP routes, response shapes or the engine's types.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterable, TypeVar

from service.errors import APIError, from_engine_error

T = TypeVar("T")
_ITEM, _ERROR, _END = range(3)


class Dispatcher:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._pool = ThreadPoolExecutor(max_workers=max_queue, thread_name_prefix="tieredkv-request")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._draining = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """From now on every generation request gets 503; those in flight run to the end."""
        self._draining = True

    def _admit(self) -> None:
        with self._lock:
            if self._draining:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if self._in_flight >= self.max_queue:
                raise APIError(429, f"the server is busy: {self.max_queue} requests in flight", code="queue_full")
            self._in_flight += 1

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _submit(self, job: Callable[[], Any]) -> Any:
        """Admit, then hand `job` to a worker that releases the admission when it is done."""
        self._admit()

        def run() -> Any:
            try:
                return job()
            finally:
                self._release()
        try:
            return self._pool.submit(run)
        except RuntimeError:          # the pool was shut down: the app is stopping
            self._release()
            raise APIError(503, "the server is shutting down", code="shutting_down") from None

    async def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a worker thread; engine errors become APIErrors, and a call
        still running after `timeout` seconds becomes a 504 (it runs on, see the docstring)."""
        future = asyncio.wrap_future(self._submit(lambda: fn(*args, **kwargs)))
        try:
            # shield: a cancelled await (client gone) leaves the call running to completion.
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise APIError(504, f"the request took longer than {timeout:g}s", code="timeout") from None
        except Exception as e:
            raise from_engine_error(e) from None

    async def stream(self, make_iter: Callable[[], Iterable[T]], timeout: float | None = None) -> "Events[T]":
        """Iterate `make_iter()` on a worker thread; its items come back through a queue. The
        worker drains the iterator to the end even if nobody reads any more."""
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

        self._submit(produce)
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
