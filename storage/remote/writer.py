"""The remote tier's write-behind: a bounded queue of blocks and the one thread that sends them.

Knows: the queue (blocks waiting to be sent, raw or already encoded), batching them, what a
drain waits for, and what is lost (a full queue drops; a failed batch is not retried -- a block
the store never got is a later miss, and whoever misses it computes and writes it again).
Doesn't know: the store, keys or the value format: it hands each batch to `send(items) -> bool`
(storage/remote/tier.py's _write_batch), which counts its own results, and each block to
`encode(item)` (the tier's: fills in a raw block's payload, and the value it stores), which runs
on the writer's encode pool (`tieredkv-remote-encode`, os.cpu_count() threads by default; zstd
releases the GIL) one batch ahead of the sends (storage/background_writer.py's look-ahead): batch
k+1 encodes while batch k is on the wire, one task per pool thread (storage/pool_drain.py; one at
a time while sequences run: storage/foreground.py); an
item whose value was made at put() skips it. A block that fails to encode is counted
(write_errors) and not sent.

Threads: `submit`, `drain`, `pending_count` from any thread (the disk writer's, the cache's
flush, the loader's); the `tieredkv-remote-writer` thread sends (the loop of
storage/background_writer.py), its pool encodes. State is under `_cond`, which is never held
while encoding or sending.
NOTE: nothing here ever waits on the network while a caller waits on it without a bound,
except drain(None) -- and the store's calls are bounded by their timeout.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from storage.background_writer import BackgroundWriter
from storage.hashing import BlockKey
from storage.foreground import PoolWidth
from storage.pool_drain import drain_on
from storage.priority import background_priority

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WriteItem:
    """One block to send: `payload` (encoded, bound to hash || namespace) or a raw `block`."""
    key: BlockKey
    payload: bytes | None = None
    raw_size: int = 0
    block: torch.Tensor | None = None
    value: bytes | None = None     # what the store gets, once encode() made it (opaque here)


@dataclass(slots=True)
class _Batch:
    items: list[WriteItem]     # what is sent (less any block that failed to encode)
    taken: int                 # how many were taken off the queue
    todo: list[int] = field(default_factory=list)      # the items to encode (no value yet), once prepared
    tasks: list[Future] = field(default_factory=list)  # the encode pool's tasks on them
    errors: dict[int, BaseException] = field(default_factory=dict)   # item -> what its encode raised


class RemoteWriter(BackgroundWriter[_Batch]):
    _look_ahead = True   # batch k+1 encodes while batch k is sent

    def __init__(self, send: Callable[[list[WriteItem]], bool], count: Callable[..., None],
                 queue_blocks: int = 256, batch_blocks: int = 32,
                 encode: Callable[[WriteItem], None] | None = None, encode_threads: int | None = None) -> None:
        if queue_blocks < 1 or batch_blocks < 1:
            raise ValueError("queue_blocks and batch_blocks must be >= 1")
        super().__init__("tieredkv-remote-writer")
        self._send = send
        self._encode = encode
        self._encode_threads = encode_threads or os.cpu_count() or 1
        self._encoder: ThreadPoolExecutor | None = None    # writer thread only; built at the first raw block
        self.encode_width = PoolWidth(self._encode_threads)  # one encoder at a time while sequences run
        self._count = count
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._queue: deque[WriteItem] = deque()
        self._queued: set[bytes] = set()     # hashes in the queue (a block queued twice is sent once)
        self._sending = 0                    # items in the writer's hands (encoding or being sent)
        self._failed = 0                     # batches that did not fully land (drain's answer)

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
        """Batches that did not fully land so far: a mark for drain(since=...)."""
        with self._cond:
            return self._failed

    def drain(self, timeout: float | None = None, since: int | None = None) -> bool:
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
        background_priority()     # sending yields the CPU to forward passes (the encode pool's threads too)

    def _on_exit(self) -> None:
        if self._encoder is not None:
            self._encoder.shutdown()
            self._encoder = None

    def _has_work(self) -> bool:
        return bool(self._queue)

    def _take(self) -> _Batch:
        items = [self._queue.popleft() for _ in range(min(self._batch_blocks, len(self._queue)))]
        for it in items:
            self._queued.discard(it.key.hash)
        self._sending += len(items)
        return _Batch(items, len(items))

    def _prepare(self, batch: _Batch) -> None:
        # An item framed already (its value made at put()) is sent as it is; the others are
        # encoded by one task per pool thread (storage/pool_drain.py: not a future per block).
        if self._encode is None:
            return
        batch.todo = [j for j, it in enumerate(batch.items) if it.value is None]
        if not batch.todo:
            return
        try:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(self._encode_threads, thread_name_prefix="tieredkv-remote-encode",
                                                   initializer=background_priority)
            batch.tasks = drain_on(self._encoder, self._encode_threads, batch.todo, lambda j: self._encode_one(batch, j),
                                   self.encode_width)
        except RuntimeError:        # no new threads (the interpreter is exiting): _ready encodes
            pass                    # them on the writer thread

    def _encode_one(self, batch: _Batch, j: int) -> None:
        try:
            self._encode(batch.items[j])
        except Exception as e:      # noqa: BLE001 -- _ready counts it and does not send the block
            batch.errors[j] = e     # one key per item, each written by the one task that took it

    def _ready(self, batch: _Batch) -> None:
        """Wait for the batch's encodes; a block that failed to encode is counted and not sent."""
        for task in batch.tasks:
            task.result()           # every item a task took is encoded (or failed) by then
        if batch.todo and not batch.tasks:
            for j in batch.todo:    # no task ran (see _prepare)
                self._encode_one(batch, j)
        if batch.errors:
            for j, e in batch.errors.items():
                log.error("remote tier: encoding block %s failed", batch.items[j].key.hash.hex()[:16], exc_info=e)
                self._count(write_errors=1)
            batch.items = [it for j, it in enumerate(batch.items) if j not in batch.errors]

    def _write(self, batch: _Batch) -> bool:
        items = batch.items
        if not items:
            return True
        try:
            return self._send(items)
        except Exception:      # never let the writer die: the cache goes on without remote writes
            log.exception("remote tier: sending a batch of %d blocks failed", len(items))
            self._count(write_errors=len(items))
            return False

    def _after(self, batch: _Batch, ok: bool) -> None:
        self._sending -= batch.taken
        if not ok:
            self._failed += 1
