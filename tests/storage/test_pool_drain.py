"""drain_on (storage/pool_drain.py): every item exactly once over a real thread pool, a failure
surfaces on its task's future, and a pool that stops taking tasks after the first still has every
item done by the task that runs."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage.pool_drain import drain_on


def test_every_item_is_taken_exactly_once_by_one_task_per_thread() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def fn(j: int) -> None:
        with lock:
            seen.append(j)
    with ThreadPoolExecutor(3) as pool:
        futures = drain_on(pool, 3, range(500), fn)
        for f in futures:
            f.result()
    assert len(futures) == 3 and sorted(seen) == list(range(500))
    with ThreadPoolExecutor(3) as pool:
        assert len(drain_on(pool, 3, [7], fn)) == 1       # never more tasks than items
        assert drain_on(pool, 3, [], fn) == []


def test_a_failure_is_raised_by_its_tasks_future() -> None:
    def fn(j: int) -> None:
        if j == 3:
            raise ValueError("item 3")
    with ThreadPoolExecutor(1) as pool:
        (f,) = drain_on(pool, 1, range(5), fn)
        with pytest.raises(ValueError, match="item 3"):
            f.result()


class RefusesAfterOne(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.taken = 0

    def submit(self, *a, **kw):
        if self.taken:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        self.taken += 1
        return super().submit(*a, **kw)


def test_a_pool_that_refuses_after_the_first_task_still_gets_every_item_done() -> None:
    done: list[int] = []
    pool = RefusesAfterOne()
    try:
        futures = drain_on(pool, 2, range(50), done.append)
        for f in futures:
            f.result()
        assert len(futures) == 1 and done == list(range(50))
        with pytest.raises(RuntimeError):             # refused the first: nothing ran, it says so
            drain_on(pool, 2, range(3), done.append)
        assert len(done) == 50
    finally:
        pool.shutdown()
