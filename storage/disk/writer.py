"""The disk tier's background writer: blocks awaiting their commit, and the thread that commits them.

Knows: the bounded queue of pending puts (a block waiting here is still served: see
PendingBlock.copy_for), the accesses reads record for it, deletes that race a commit
(cancelled), batching many blocks into one write transaction with compression done outside it
(group commit: a burst lingers to fill a batch, and the batch ahead is topped up), the capacity
it enforces in that transaction (what the transaction writes: storage/disk/batch_txn.py), and
what to do when LMDB runs out of map or disk (MapFull/ENOSPC: make room, retry smaller, drop
what still does not fit).

Compression runs in the encode process while sequences decode (a child: its per-block Python
holds its own GIL: storage/codec/encode_process.py), else on a pool (`tieredkv-disk-encode`);
storage/disk/batch_encoder.py decides. It is pipelined with the commits (storage/
background_writer.py's look-ahead): batch k+1 encodes while batch k commits (LMDB's copy and
fsync), never more than one batch ahead, commits in order (tools/bench_write_pool.py).
Doesn't know: the read path or verification (storage/disk/tier.py, storage/disk/integrity.py),
how room is made in the store (LRU eviction, the map bounded by free space: storage/disk/room.py),
or the byte layout of the records beyond storage/disk/records.py's functions.

Write failures never reach the caller of put: they are logged and counted (write_errors), and
drain() reports them: it is True only when nothing was dropped while it waited. A failure that
says the directory takes no writes (read-only, EIO, gone) turns the writes off instead of
dropping batch after batch: storage/disk/write_switch.py, which probes until they can resume.

Stale readers (a process killed inside a read transaction pins every page its snapshot saw, so
the file grows past the capacity): cleared (reader_check) at start, every few seconds, before evicting.
Retention deadlines (storage/disk/retained.py) are written with the next batch.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import lmdb

from storage.background_writer import BackgroundWriter
from storage.foreground import PoolWidth
from storage.priority import background_priority
from storage.codec.encode_process import EncodeProcessStats
from storage.codec.payload import Codec
from storage.disk.batch_encoder import BatchEncoder, Encoding
from storage.disk.gate import EnvGate
from storage.disk.verdicts import is_damage, is_no_space
from storage.disk.write_switch import WriteSwitch, stops_writes
from storage.disk.batch_txn import write_batch
from storage.disk.records import StoreInfo, load_info
from storage.disk.room import FreeSpace, make_room
from storage.disk.stall import DiskStalled
from storage.disk.index import DiskIndex
from storage.disk.pending import PendingBlock
from storage.hashing import BlockKey
from storage.retention import RetainRow

if TYPE_CHECKING:      # blocks are tensors, but nothing here makes one: `tieredkv inspect`/`verify` load no torch
    import torch

log = logging.getLogger(__name__)

_READER_CHECK_S = 5.0   # how often the writer clears dead processes' reader slots


@dataclass(slots=True)
class _Batch:
    """What the writer took at once: puts and accesses, and the puts' encodings as they come."""
    items: list[PendingBlock]
    touches: dict[bytes, int]
    retains: list[RetainRow] = field(default_factory=list)     # deadlines to write (storage/disk/retained.py)
    encoding: Encoding | None = None     # its encodes in flight, once prepared
    more: list[Encoding] = field(default_factory=list)   # its top-ups' encodes (on the pool)
    # Once ready: what encoded (NOTE: a payload may be a view of the encode process's memory, valid
    # until the batch after next is prepared: committed before then).
    encoded: list[tuple[PendingBlock, bytes | memoryview]] = field(default_factory=list)


class DiskWriter(BackgroundWriter[_Batch]):
    """Pending puts and recorded accesses, committed in batches by one thread, encoded on a pool
    one batch ahead of the commits. Thread-safe.

    `count(**deltas)` receives the writer's share of the tier's counters (bytes_written,
    evictions, write_errors). Nothing runs until start().
    """

    _look_ahead = True   # batch k+1 encodes while batch k commits
    # Group commit (storage/background_writer.py): every commit pays an fsync (~2-5 ms here even
    # for one block), so a burst of puts waits to fill a batch while its blocks keep coming.
    _linger_gap_s = 0.001
    _linger_max_s = 0.010

    def __init__(self, gate: EnvGate, codec: Codec, capacity_bytes: int,
                 queue_blocks: int, batch_blocks: int, count: Callable[..., None], index: DiskIndex,
                 reserve_bytes: int | None = None, map_size: int | None = None,
                 encode_threads: int | None = None, encode_process: str | None = None) -> None:
        super().__init__("tieredkv-disk-writer")
        # The tier's environment and every transaction on it: counted for close(), map resizes
        # adopted, a damaged store replaced. NOTE: read self._gate.dbs inside a transaction only.
        self._gate = gate
        self._begin = gate.begin
        self._index = index      # updated after each commit, before a put stops being pending
        self._codec = codec
        self._capacity_bytes = capacity_bytes
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._count = count
        self._pending: dict[bytes, PendingBlock] = {}   # every put not yet committed (queued or in flight)
        self._queue: deque[bytes] = deque()             # pending hashes the writer has not taken yet
        self._touches: dict[bytes, int] = {}            # hash -> reads to record, in access order
        self._retains: list[RetainRow] = []             # retention deadlines to write with the next batch
        self.clock: Callable[[], float] = time.time     # wall-clock seconds: retention deadlines (set by the tier)
        self.retains_lost: Callable[[list[RetainRow]], None] | None = None   # rows not written (set by the tier)
        # NOTE: a put in the writer's hands (taken, encoding or committing) was cancelled when _pending
        # no longer maps its hash to that very PendingBlock (a delete popped it, or a new put of the
        # same hash replaced it): checked inside the commit's transaction.
        # How batches are encoded (writer thread only): in the encode process unless
        # `encode_process` is None, on the pool what it cannot (storage/disk/batch_encoder.py).
        self._encoding = BatchEncoder(codec, encode_threads or os.cpu_count() or 1, encode_process)
        self._dropped = 0                               # blocks ever dropped (never committed)
        self._last_reader_check = 0.0                   # writer thread only
        # Called on the writer thread after each commit with (key, payload, raw size) of every block
        # it stored: the remote tier's write-behind (a block is compressed once for both).
        self.on_commit: Callable[[list], None] | None = None
        self.seal = None      # set by the tier before start: a shared directory's records sealed (disk/seal.py)
        # Called on the writer thread every few seconds (with the stale-reader check): the store's
        # files checked, a store another process moved aside followed (storage/disk/replacement.py).
        self.on_tick: Callable[[], None] | None = None
        # After each commit (writer thread): the store's counters and capacity, for stats() (stall.py).
        self.on_info: Callable[[StoreInfo, int], None] | None = None
        # The filesystem's free space (issue 17, item 2): the store never grows into the last
        # `reserve_bytes` of it. Writer thread only, but for `space` (read by stats()).
        self._room = FreeSpace(gate, capacity_bytes, reserve_bytes, map_size)
        # Off while the directory takes no writes (storage/disk/write_switch.py); the writer's thread turns it.
        self._switch = WriteSwitch(gate.files.path)

    @property
    def writes_off(self) -> str | None:
        """Why the tier writes nothing now (its directory cannot be written), or None. Any thread."""
        return self._switch.off

    # -- the tier's side -------------------------------------------------------------------

    def is_pending(self, h: bytes) -> bool:
        with self._cond:
            return h in self._pending

    def pending(self, hashes: Iterable[bytes]) -> list[PendingBlock | None]:
        with self._cond:
            return [self._pending.get(h) for h in hashes]

    def pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def submit(self, key: BlockKey, block: torch.Tensor | None, wait: bool = True, payload: bytes | None = None,
               raw_size: int = 0, timeout: float | None = None) -> bool:
        """Queue `block` (a private CPU copy) unless its hash is pending already. With
        wait=False (the engine's eviction cascade) it never waits: it may fill the queue to twice
        its bound, and past that returns False (the block is not queued); with wait=True, False once
        `timeout` passed with the queue still full. `payload` (block None,
        `raw_size` its bytes): the block already encoded and verified (a remote read's),
        committed as it is."""
        h = key.hash
        with self._cond:
            # NOTE: the queue bound -- put waits here while queue_blocks blocks are pending; the
            # cascade, which must not wait, has a second bound of as many again before it drops.
            if not wait and len(self._pending) >= 2 * self._queue_blocks:
                return False
            if wait and not self._wait_for(lambda: len(self._pending) < self._queue_blocks or self._stopping, timeout):
                return False
            if self._stopping:
                raise RuntimeError("DiskTier is closed")
            if h not in self._pending:
                self._pending[h] = PendingBlock(key, block, payload, raw_size)
                self._queue.append(h)
                self._cond.notify_all()
            return True

    def record_accesses(self, hashes: Iterable[bytes]) -> None:
        """One hit for each hash, committed (LRU position and hit count) with the next batch."""
        with self._cond:
            for h in hashes:
                self._touches[h] = self._touches.pop(h, 0) + 1
            self._cond.notify_all()

    def record_retains(self, rows: Iterable[RetainRow]) -> None:
        """Retention deadlines, written (merged with the stored ones) with the next batch."""
        with self._cond:
            self._retains.extend(rows)
            self._cond.notify_all()

    def cancel(self, h: bytes) -> bool:
        """Forget a pending put of `h`. True when there was one."""
        with self._cond:
            p = self._pending.pop(h, None)   # one the writer has: its commit sees it is no longer pending
            if p is not None:
                if h in self._queue:
                    self._queue.remove(h)
                self._cond.notify_all()
        return p is not None

    def cancel_all(self) -> None:
        with self._cond:
            self._pending.clear()
            self._queue.clear()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Block until every queued put and access update is committed (including those other
        threads add meanwhile). False on timeout, if the writer thread is gone, or if any block
        was dropped instead of committed while waiting -- or since `since`, a dropped() mark taken
        before the puts, so a batch lost before this call began counts too (NOTE: never True
        after a lost write)."""
        with self._cond:
            dropped_before = self._dropped if since is None else since
            return (self._wait_for(lambda: not self._pending and not self._touches and not self._retains
                                   and not self._busy, timeout,
                                   needs_thread=True)
                    and self._dropped == dropped_before)

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block until fewer than queue_blocks puts are pending (False on timeout or stop)."""
        with self._cond:
            return (self._wait_for(lambda: len(self._pending) < self._queue_blocks or self._stopping, timeout)
                    and not self._stopping)

    def dropped(self) -> int:
        with self._cond:
            return self._dropped

    def lost(self, n: int) -> None:
        """n blocks will never be committed: counted for stats() and for drain()'s answer."""
        if n:
            with self._cond:
                self._dropped += n
            self._count(write_errors=n)

    # -- the writer thread -----------------------------------------------------------------

    def clear_stale_readers(self, force: bool = False) -> int:
        """Free the reader slots of dead processes (LMDB's reader_check). Returns how many."""
        now = time.monotonic()
        if not force and now - self._last_reader_check < _READER_CHECK_S:
            return 0
        self._last_reader_check = now
        if self.on_tick is not None:
            self.on_tick()
        try:
            n = 0 if self._gate.down is not None else self._gate.reader_check()   # (an abandoned env: not)
        except (lmdb.Error, OSError) as e:
            if not isinstance(e, DiskStalled):          # (a stall is said once, by its watch)
                log.warning("disk tier: reader_check failed: %s", e)
            return 0
        if n:
            log.warning("disk tier: cleared %d stale reader slot(s) of dead processes", n)
        return n

    def _on_start(self) -> None:
        background_priority()   # commits yield the CPU to forward passes (the encode pool's threads too)
        self.clear_stale_readers(force=True)

    def _on_exit(self) -> None:
        self._encoding.close()           # the encode process exits and is reaped; the pool ends

    def _has_work(self) -> bool:
        return bool(self._queue or self._touches or self._retains) or self._switch.due()

    def _idle_timeout(self) -> float | None:
        return self._switch.wait()

    def _take(self) -> _Batch:
        if self._switch.off is not None:
            # Writes off: what was queued before is dropped unencoded, the accesses forgotten; the
            # batch is empty and its write a probe (_write).
            dropped = [self._pending.pop(h) for h in self._queue if h in self._pending]
            self._queue.clear()
            self._touches, retains, self._retains = {}, self._retains, []
            self.lost(len(dropped))
            self._lose_retains(retains)
            return _Batch([], {})
        items = self._pop_queued(self._batch_blocks)
        touches, self._touches = self._touches, {}
        retains, self._retains = self._retains, []
        return _Batch(items, touches, retains)

    def _pop_queued(self, most: int) -> list[PendingBlock]:
        """Under _cond: up to `most` queued puts, taken off the queue in order (still pending)."""
        return [self._pending[self._queue.popleft()] for _ in range(min(most, len(self._queue)))]

    def _queued(self) -> int:
        return len(self._queue)

    def _batch_limit(self) -> int:
        return min(self._batch_blocks, self._queue_blocks)

    def _top_up(self, batch: _Batch) -> bool:
        """The look-ahead batch filled up with what was queued while the batch before it committed
        (its new blocks encode on the pool: `_prepare_more`). Its accesses and deadlines stay
        queued for the batch after."""
        n = min(self._batch_blocks - len(batch.items), len(self._queue))
        if self._switch.off is not None or n <= 0 or batch.encoding is None or self._encoding.in_process():
            return False      # (while the encode process takes batches, the pool's Python would hold the engine's GIL)
        extra = self._pop_queued(n)
        batch.items = batch.items + extra        # a new list: the first encoding holds the old one
        batch.more.append(Encoding(extra, [it.payload for it in extra]))   # started by _prepare_more
        return True

    def _prepare_more(self, batch: _Batch) -> None:
        batch.more[-1] = self._encoding.start(batch.more[-1].items, pool_only=True)

    # -- encoding: in the encode process or on the pool, a batch ahead of the commits (never on the
    # writer's thread inside a transaction: the pool's tasks are only handed their blocks there, by
    # start_deferred, once the body is done); storage/disk/batch_encoder.py -------------------------

    def _defer_prepare(self, batch: _Batch) -> bool:
        # Started by _commit once its body is done (storage/background_writer.py): encoding on the
        # pool during the body took the GIL from its ~100 LMDB calls (small puts 13x slower, the
        # whole batch ~15% slower, measured). Not for the encode process: handing it a batch copies
        # the blocks on this thread, which would lengthen the write lock's hold.
        return not self._encoding.in_process()

    def _prepare(self, batch: _Batch) -> None:
        batch.encoding = self._encoding.start(batch.items)

    def _ready(self, batch: _Batch) -> None:
        """Collect the batch's encodings; a block that fails to encode is dropped (counted)."""
        encoded, failed = self._encoding.finish(batch.encoding)
        for enc in batch.more:        # its top-ups, in the order they were queued
            e, f = self._encoding.finish(enc)
            encoded, failed = encoded + e, failed + f
        batch.encoded = encoded
        for it, e in failed:
            log.error("disk tier: encoding block %s failed", it.key.hash.hex()[:16], exc_info=e)
            self.lost(1)

    @property
    def encode_width(self) -> PoolWidth:
        """How many blocks encode at once (the pool's tasks, or the encode process's threads)."""
        return self._encoding.width

    def encode_process_stats(self) -> EncodeProcessStats | None:
        """The encode process's counters (any thread), or None while it has never been used."""
        return self._encoding.process_stats()

    def fit_to_space(self, force: bool = False) -> None:
        """Bound the data file by the filesystem's free space minus the reserve (storage/disk/room.py)."""
        self._room.fit(force)

    @property
    def space(self) -> tuple[int | None, int | None]:
        """(free bytes, the map's bound or None): read by stats() from any thread."""
        return self._room.space

    def _lose_retains(self, rows: list[RetainRow]) -> None:
        if rows and self.retains_lost is not None:
            self.retains_lost(rows)

    def _write(self, batch: _Batch) -> bool:
        encoded, touches = batch.encoded, batch.touches
        if self._switch.off is not None:
            self._lose_retains(batch.retains)
            if not batch.items and not touches:
                # Its store's files checked first (a remounted filesystem is another store: the
                # tick follows it), then one empty transaction committed.
                self._switch.try_on(lambda: (self.clear_stale_readers(force=True), self._commit([], {})))
            else:
                self.lost(len(encoded))         # taken before the writes went off
            return not encoded
        for attempt in range(2):
            try:
                self.clear_stale_readers()
                self.fit_to_space()
                self._write_batch(encoded, touches, batch.retains)
                return True
            except DiskStalled:
                self.lost(len(encoded))         # the filesystem is not answering: said once by the stall watch
                self._lose_retains(batch.retains)
                return False
            except Exception as e:   # never let the writer die: the engine keeps running without disk writes
                if attempt == 0 and is_damage(e):
                    # The gate has had the store replaced (storage/disk/environment.py): the batch's
                    # blocks are sound, so they go to the fresh store once; the accesses do not.
                    log.warning("disk tier: the store was damaged (%s); writing the batch to the fresh store", e)
                    touches = {}
                    continue
                self.lost(len(encoded))
                self._lose_retains(batch.retains)
                if stops_writes(e):
                    self._switch.turn_off(e, len(encoded))     # one line, not one per batch
                else:
                    log.exception("disk tier: writing a batch of %d blocks failed; dropping it", len(encoded))
                return False
        return False

    def _failed(self, batch: _Batch) -> None:
        self.lost(len(batch.items))       # drain() must not say True after this
        self._lose_retains(batch.retains)

    def _after(self, batch: _Batch, ok: bool) -> None:
        for it in batch.items:
            if self._pending.get(it.key.hash) is it:
                del self._pending[it.key.hash]

    def _write_batch(self, encoded: list[tuple[PendingBlock, bytes]], touches: dict[bytes, int],
                     retains: list[RetainRow]) -> None:
        """Commit the batch's encoded blocks, its accesses and its retention deadlines (encoded
        by _prepare/_ready)."""
        if self._try_commit(encoded, touches, retains):
            return
        if retains and not self._try_commit([], {}, retains):
            log.warning("disk tier: %d retention deadline(s) could not be written", len(retains))
            self._lose_retains(retains)
        if len(encoded) > 1:   # the batch does not fit as a whole: try each block alone
            for e in encoded:
                if not self._try_commit([e], {}):
                    self.lost(1)
        else:
            self.lost(len(encoded))

    def _try_commit(self, encoded: list, touches: dict[bytes, int], retains: list[RetainRow] = ()) -> bool:
        """Commit, making room on MapFull/ENOSPC; False when it still does not fit."""
        need = sum(len(p) for _, p in encoded)
        for attempt in range(4):
            try:
                self._commit(encoded, touches, retains)
                return True
            except Exception as e:
                if not is_no_space(e, self._gate.env.path()):
                    raise
                log.warning("disk tier: %s; evicting to make room (attempt %d)", type(e).__name__, attempt + 1)
                self.clear_stale_readers(force=True)   # a dead reader may be what pins the pages
                self.fit_to_space(force=True)
            # Free at least the batch or 10% of the store, more on each attempt. LMDB reuses freed
            # pages only once no transaction can still see them, hence several attempts.
            with self._begin() as txn:
                info = load_info(txn, self._gate.dbs)
            if make_room(self._begin, self._gate, self._index, self._count, self.clock(),
                         max(need, info.used_bytes // 10) << attempt) == 0 and info.blocks == 0:
                break
        log.warning("disk tier: no room for %d block(s) after evicting; dropping them", len(encoded))
        return False

    def _commit(self, encoded: list, touches: dict[bytes, int], retains: list[RetainRow] = ()) -> None:
        with self._begin(write=True) as txn:
            dbs = self._gate.dbs
            info = load_info(txn, dbs)
            capacity = store_capacity = self._room.capacity_in(txn)
            if self._room.growth_left is not None:
                # Bounded by free space: grow by at most most of what the file may still grow
                # (page rounding and copy-on-write pages need the rest); MapFull catches the rest.
                capacity = min(capacity, info.used_bytes + self._room.growth_left * 3 // 4)
            with self._cond:
                # NOTE: read inside the write txn, so a delete() either cancelled the put before
                # this (the block is skipped) or starts its own write txn after this one commits
                # (and then sees the block). A put is live while _pending maps its hash to it.
                live = [(it, p) for it, p in encoded if self._pending.get(it.key.hash) is it]
            done = write_batch(txn, dbs, info, capacity, self.clock(), live, touches, list(retains),
                               self.seal, keep_payloads=self.on_commit is not None)
            self.start_deferred()      # the next batch's encodes overlap this commit's fsync
        # Committed: now the index says so. In the transaction every put came before every
        # eviction (a batch larger than the capacity evicts its own first blocks), so the same
        # order here: stored, then evicted.
        self._index.add_keys(done.stored)    # BlockStored (DISK) for the new ones
        self._index.discard(done.evicted)
        self._count(bytes_written=done.written, evictions=len(done.evicted))
        if self.on_info is not None:
            self.on_info(done.info, store_capacity)
        if done.new and self.on_commit is not None:
            try:
                self.on_commit(done.new)
            except Exception:   # the disk tier's commit stands whatever the write-behind does
                log.exception("disk tier: forwarding %d committed blocks failed", len(done.new))
