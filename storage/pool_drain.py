"""Work spread over a thread pool as one task per thread, each taking the next item until none is left.

Knows: why not a future per item -- each one cost ~7.5 us of CPU with the GIL held (submit, the
future, its result) against ~0.2 us an item this way, on the very thread that reads or commits,
and a slow thread takes fewer items instead of holding the batch up. Doesn't know what the work
is or what becomes of a failure: `fn` records its own results; an exception it lets escape ends
that task (its future raises it) and leaves the items it had not taken to the other tasks.
Used by the disk and remote tiers' reads (decode) and the disk and remote writers' batches (encode);
the writers pass a `PoolWidth` (storage/foreground.py): fewer of their tasks work at once while
sequences decode.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Iterable

from storage.foreground import PoolWidth


def drain_on(pool: Executor, threads: int, items: Iterable[int], fn: Callable[[int], None],
             width: PoolWidth | None = None) -> list[Future]:
    """Submit min(threads, len(items)) tasks to `pool` that call fn(j) for every j of `items`, each
    j exactly once (deque.popleft is atomic); the futures, to wait on. When the pool refuses a
    task (RuntimeError: shut down, or the interpreter is exiting) after one was taken, the tasks
    already running take every item; when it refuses the first, the RuntimeError is raised and
    nothing ran. With `width`, a task takes its next item only when fewer than width.limit() tasks
    (of every batch on that width) are inside one."""
    left = deque(items)

    def drain() -> None:
        while True:
            if width is not None:
                if not left:            # nothing to wait for a turn for
                    return
                width.acquire()
            try:
                try:
                    j = left.popleft()
                except IndexError:
                    return
                fn(j)
            finally:
                if width is not None:
                    width.release()
    futures: list[Future] = []
    for _ in range(min(threads, len(left))):
        try:
            futures.append(pool.submit(drain))
        except RuntimeError:
            if not futures:
                raise
            break
    return futures
