"""How the disk writer's batches are encoded: in the encode process while sequences decode, or on
a pool in this one.

Knows: which of a batch's blocks need encoding (a payload already encoded, a remote read's, is
stored as it is), handing them to the encode process (storage/codec/encode_process.py: the
per-block Python of an encode then holds the child's GIL, not the engine's) and taking back its
checked payloads, and the pool (`tieredkv-disk-encode`, one task per thread taking the next block:
storage/pool_drain.py) that encodes what the process did not -- every block when it is off, a
batch whose child was killed, a payload it refused, a block it could not be given. Either way
a batch is encoded a batch ahead of the commits (`start` as it is taken, `finish` before its
commit: storage/background_writer.py's look-ahead). `width` is how many encode at once (the
pool's tasks, the child's threads): narrowed while sequences decode (storage/foreground.py).
The process takes a batch only while sequences decode in this process (the foreground signal set
when the batch starts): that is when the engine's GIL is worth keeping free, and the child runs
at SCHED_IDLE, which other processes' work (another server, a test worker) would starve of CPU
for as long as it keeps the cores busy -- with nothing decoding here, the pool (nice +10, full
width) keeps the write path's throughput as before.
Doesn't know: the queue, the store or what a failure costs (the writer drops the block, counted).

Threads: the writer thread only (start, finish, close); process_stats() from any.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from storage.codec.encode_process import EncodeJob, EncodeProcess, EncodeProcessStats, EncodeTicket
from storage.codec.payload import Codec, tensor_bytes
from storage.codec.stored_block import payload_binding
from storage.disk.pending import PendingBlock
from storage.foreground import FOREGROUND, PoolWidth
from storage.layout import dtype_name
from storage.pool_drain import drain_on
from storage.priority import background_priority

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Encoding:
    """One batch's encodes in flight."""
    items: list[PendingBlock]
    # Per item: its payload, what its encode raised, or None while it is not encoded yet.
    results: list[bytes | memoryview | BaseException | None]
    tasks: list[Future] = field(default_factory=list)      # the pool's tasks on this batch
    given: list[int] = field(default_factory=list)         # the items handed to the encode process
    ticket: EncodeTicket | None = None                     # the process's batch, until collected


class BatchEncoder:
    def __init__(self, codec: Codec, threads: int, process_policy: str | None) -> None:
        self._codec = codec
        self._threads = threads
        self.width = PoolWidth(threads)              # one encoder at a time while sequences run
        self.pool: ThreadPoolExecutor | None = None  # built at the first block the pool encodes
        self._policy = process_policy                # None: no encode process ("idle", "nice")
        self._process: EncodeProcess | None = None   # built at the first batch

    def start(self, items: list[PendingBlock], pool_only: bool = False) -> Encoding:
        """Start encoding the batch (never raises, never waits for an encode). `pool_only`: never
        in the encode process -- a batch's top-up (storage/background_writer.py): the process's
        payloads are views of its memory that stay valid for two of its batches, and a third
        ticket before the topped-up batch commits would reuse them."""
        enc = Encoding(items, [it.payload for it in items])
        todo = [j for j, r in enumerate(enc.results) if r is None]
        if todo and not pool_only and self.in_process():
            todo = self._to_process(enc, todo)
        if todo:
            self._to_pool(enc, todo)
        return enc

    def in_process(self) -> bool:
        """Whether a batch started now would go to the encode process (sequences decode here)."""
        return self._policy is not None and FOREGROUND.active()

    def finish(self, enc: Encoding) -> tuple[list[tuple[PendingBlock, bytes | memoryview]],
                                             list[tuple[PendingBlock, BaseException]]]:
        """Wait for the batch: (item, payload) of each block encoded, in order, and (item, error)
        of each that failed."""
        if enc.ticket is not None:
            ticket, enc.ticket = enc.ticket, None
            missing = []
            try:
                got = self._process.collect(ticket)
            except Exception:                 # noqa: BLE001 -- never lose a batch to the process
                log.exception("encode process: collecting a batch failed; encoding it here")
                got = [None] * len(enc.given)
            for j, payload in zip(enc.given, got):
                enc.results[j] = payload
                if payload is None:
                    missing.append(j)
            if missing:                       # the child died, or a payload was refused: encoded here
                self._to_pool(enc, missing)
        for task in enc.tasks:
            task.result()                     # every block a task took is encoded (or failed) then
        done, failed = [], []
        for j, it in enumerate(enc.items):
            r = enc.results[j]
            if r is None:                     # no task ran (no threads to be had): on this thread
                try:
                    r = self._encode(it)
                except Exception as e:        # noqa: BLE001
                    r = e
            if isinstance(r, BaseException):
                failed.append((it, r))
            else:
                done.append((it, r))
        return done, failed

    def close(self) -> None:
        """The encode process told to exit and reaped; the pool shut down."""
        if self._process is not None:
            self._process.close()
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def process_stats(self) -> EncodeProcessStats | None:
        process = self._process
        return None if process is None else process.stats()

    def _to_process(self, enc: Encoding, todo: list[int]) -> list[int]:
        """Hand what it can of `todo` to the encode process; what is left for the pool."""
        jobs, given, left = [], [], []
        for j in todo:
            it = enc.items[j]
            try:
                jobs.append(EncodeJob(tensor_bytes(it.block), dtype_name(it.block.dtype), tuple(it.block.shape),
                                      payload_binding(it.key.hash, it.key.namespace)))
                given.append(j)
            except Exception:                 # noqa: BLE001 -- the pool's encode says what is wrong with it
                left.append(j)
        try:
            if self._process is None:
                self._process = EncodeProcess(self._codec.kind, self._codec.level, self._policy)
            enc.ticket = self._process.submit(jobs, self.width.limit())
        except Exception:                     # noqa: BLE001 -- never lose a batch to the process
            log.exception("encode process: handing a batch over failed; encoding it here")
            enc.ticket = None
        if enc.ticket is None:
            return todo
        enc.given = given
        return left

    def _to_pool(self, enc: Encoding, todo: list[int]) -> None:
        def encode(j: int) -> None:
            try:
                enc.results[j] = self._encode(enc.items[j])
            except Exception as e:            # noqa: BLE001 -- finish() reports it
                enc.results[j] = e
        try:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tieredkv-disk-encode",
                                               initializer=background_priority)
            enc.tasks += drain_on(self.pool, self._threads, todo, encode, self.width)
        except RuntimeError:                  # no new threads (the interpreter is exiting): finish()
            pass                              # encodes what no task took, on the writer thread

    def _encode(self, it: PendingBlock) -> bytes:
        return self._codec.encode(it.block, payload_binding(it.key.hash, it.key.namespace))
