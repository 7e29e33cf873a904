"""The remote tier's write-behind: a bounded queue of blocks and the one thread that sends them.

Knows: the queue (blocks waiting to be sent, raw or already encoded), batching them, what a
flush waits for, and what is lost (a full queue drops; a failed batch is not retried -- a block
the store never got is a later miss, and whoever misses it computes and writes it again).
Doesn't know: the store, keys or the value format: it hands each batch to `send(items) -> bool`
(storage/remote/tier.py's _write_batch), which counts its own results.

Threads: `submit`, `flush`, `pending_count` from any thread (the disk writer's, the cache's
flush, the loader's); the `tieredkv-remote-writer` thread sends (the loop of
storage/background_writer.py). State is under `_cond`, which is never held while sending.
NOTE: nothing here ever waits on the network while a caller waits on it without a bound,
except flush(None) -- and the store's calls are bounded by their timeout.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from storage.background_writer import BackgroundWriter
from storage.hashing import BlockKey
from storage.priority import background_priority

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WriteItem:
    """One block to send: `payload` (encoded, bound to hash || namespace) or a raw `block`."""
    key: BlockKey
    payload: bytes | None = None
    raw_size: int = 0
    block: torch.Tensor | None = None


class RemoteWriter(BackgroundWriter[list[WriteItem]]):
    def __init__(self, send: Callable[[list[WriteItem]], bool], count: Callable[..., None],
                 queue_blocks: int = 256, batch_blocks: int = 32) -> None:
        if queue_blocks < 1 or batch_blocks < 1:
            raise ValueError("queue_blocks and batch_blocks must be >= 1")
        super().__init__("tieredkv-remote-writer")
        self._send = send
        self._count = count
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._queue: deque[WriteItem] = deque()
        self._queued: set[bytes] = set()     # hashes in the queue (a block queued twice is sent once)
        self._sending = 0                    # items being sent now
        self._failed = 0                     # batches that did not fully land (flush's answer)

    def submit(self, item: WriteItem, wait: bool = False, timeout: float | None = None) -> bool:
        """Queue a block. wait=False never waits: a full queue drops it (False, counted in
        write_drops). wait=True waits for room (up to `timeout`, then drops)."""
        with self._cond:
            if item.key.hash in self._queued:
                return True
            if wait:
                self._wait_for(lambda: len(self._queue) < self._queue_blocks or self._stopping, timeout)
            if self._stopping or len(self._queue) >= self._queue_blocks:
                self._count(write_drops=1)
                return False
            self._queue.append(item)
            self._queued.add(item.key.hash)
            self._cond.notify_all()
            return True

    def pending_count(self) -> int:
        with self._cond:
            return len(self._queue) + self._sending

    def failures(self) -> int:
        """Batches that did not fully land so far: a mark for flush(since=...)."""
        with self._cond:
            return self._failed

    def flush(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Wait until everything queued (now and meanwhile) was sent. False on timeout, if the
        thread is gone, or if a batch did not fully land while waiting -- or since `since` (a
        failures() mark taken before the writes were queued: a batch may fail before the wait)."""
        with self._cond:
            failed_before = self._failed if since is None else since
            return self._wait_for(self._drained, timeout, needs_thread=True) and self._failed == failed_before

    def stop(self, timeout: float | None = 30) -> None:
        super().stop(timeout)

    # ---- the writer thread ---------------------------------------------------------------------
    def _on_start(self) -> None:
        background_priority()     # encoding yields the CPU to forward passes

    def _has_work(self) -> bool:
        return bool(self._queue)

    def _take(self) -> list[WriteItem]:
        items = [self._queue.popleft() for _ in range(min(self._batch_blocks, len(self._queue)))]
        for it in items:
            self._queued.discard(it.key.hash)
        self._sending = len(items)
        return items

    def _write(self, items: list[WriteItem]) -> bool:
        try:
            return self._send(items)
        except Exception:      # never let the writer die: the cache goes on without remote writes
            log.exception("remote tier: sending a batch of %d blocks failed", len(items))
            self._count(write_errors=len(items))
            return False

    def _after(self, items: list[WriteItem], ok: bool) -> None:
        self._sending = 0
        if not ok:
            self._failed += 1
