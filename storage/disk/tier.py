"""The disk tier: compressed KV blocks in an LMDB environment, with an LRU capacity bound.

Knows: the public face of the disk tier (storage/lower_tier.py's verbs and the operator's) --
put (handed to the background writer), deletes, clear, drain/close, stats, verify/repair and the
check() audit -- and this process's counters. Its parts live beside it in storage/disk/: reads.py
(verified reads from the store or a pending put, read-ahead, iteration: a base class of
DiskTier), environment.py (opening),
gate.py (every transaction), liveness.py (the files checked before each), verdicts.py and
replacement.py (damage; the store replaced while serving), records.py (databases, formats),
writer.py and pending.py (the queue, the encode pool, the thread that commits and evicts),
integrity.py (verify, audit), index.py (the stored hashes in memory), stats.py.
Doesn't know: the other tiers, models, or when a block should be demoted (storage/cascade.py).

Every counter that defines capacity lives in `info` and changes in the same write
transaction as the blocks it counts, so several processes sharing one directory keep them
right (LMDB serializes writers across processes). LMDB commits are atomic, so the directory
opens after a crash at the last committed state; the index is the `meta` database, so
opening scans nothing.

Capacity is a property of the store, not of a process: it lives in `info`, each writer reads it
inside its commit, so processes sharing a directory always enforce one bound. A process opening
with another capacity sets it (a restart with a new setting takes effect) and says so loudly;
a process whose own setting was overridden meanwhile warns once. The map size follows: a process
maps at least the file's own size and adopts a size another process grew (EnvGate.begin).

Store hits/misses/corrupt/evictions/bytes counters in `stats()` are this process's own.

NOTE invariant: the read paths (contains, get, get_many: storage/disk/reads.py) never raise a
storage error: an LMDB or OS error while reading is a miss, counted in `read_errors` and logged.
A cache that cannot read must cost a recompute, never a failed or hung request (issue 7, item 2).
A filesystem that stops answering (frozen, hung: storage/disk/stall.py) is the same, without the
wait: while a storage call has been in flight past `stall_s`, contains() is False, reads are misses,
puts are refused (writes_off_drops) and stats() answers from memory (issue 44, item 3).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable, Sequence

from storage.codec.payload import Codec
from storage.disk.integrity import DamagedBlock, VerifyReport, audit, verify_store
from storage.disk.index import DiskIndex
from storage.disk.environment import DiskUnavailable, default_map_size, open_env, open_writable
from storage.disk.gate import EnvGate
from storage.disk.preflight import DamagedEnvironment
from storage.disk.reads import DiskReads
from storage.disk.replacement import MAX_REPLACEMENTS, StoreReplacement
from storage.disk.stall import DEFAULT_STALL_S, DiskStalled
from storage.codec.encode_process import encode_process_policy
from storage.disk.records import load_sealed
from storage.disk.seal import DiskSeal, settle, verifiable
from storage.disk.stats import DiskBlockInfo, DiskStats, _Counters
from storage.disk.pagewalk import check_pages
from storage.disk.records import (DISK_FORMAT_VERSION, StoreInfo, delete_in_txn, load_capacity, load_info,
                                  repair_counters, store_info)
from storage.disk.records import recount as recount_info
from storage.disk.retained import DiskRetention
from storage.disk.writer import DiskWriter
from storage.layout import BlockLayout, dtype_name
from storage.malloc_tuning import keep_freed_memory
from storage.lower_tier import LowerTier, owned_or_copied
from storage.tier_kinds import DISK
from storage.hashing import BlockKey

if TYPE_CHECKING:      # blocks are tensors, but nothing here makes one: `tieredkv inspect`/`verify` load no torch
    import torch

__all__ = ["DISK_FORMAT_VERSION", "MAX_REPLACEMENTS", "DamagedBlock", "DamagedEnvironment", "DiskBlockInfo",
           "DiskStats", "DiskTier", "DiskUnavailable", "VerifyReport", "default_map_size"]

log = logging.getLogger(__name__)

# The free space the tier leaves on its filesystem by default, whatever its capacity: the billing
# ledger beside it, logs and the rest of the machine need it (issue 17: a full filesystem failed
# every request, the ledger unable to commit while the KV store kept the disk full).
DEFAULT_RESERVE_BYTES = 256 << 20
_STATUS_WAIT_S = 0.5     # stats() waits at most this for the store's counters, then answers the last ones read


class DiskTier(DiskReads, DiskRetention, LowerTier):
    """Blocks on disk, LRU-bounded by stored (compressed) bytes. Thread-safe.

    put() hands a block to a background writer thread; get()/get_many() verify before
    serving; a block that fails verification is counted as corrupt, deleted, and missed.
    readonly=True opens for inspection next to a running writer (no writer thread; get()
    neither records accesses nor deletes damaged blocks). reserve_bytes: the free space the
    store leaves on its filesystem, whatever its capacity (None: only the capacity bounds it).
    decode_threads / encode_threads: the read path's decode pool and the writer's encode pool
    (default: os.cpu_count() each; zstd releases the GIL). encode_process: where the writer
    encodes -- "auto" ($TIEREDKV_ENCODE_PROCESS: "idle" unless "0" or "nice"), "idle" or "nice" (a child
    process at that priority, storage/codec/encode_process.py), None (the pool in this process).
    stall_s: how long a storage call may wait on the filesystem before the tier counts as stalled
    (storage/disk/stall.py).
    """

    def __init__(self, path: str, capacity_bytes: int, codec: Codec = Codec(), *, layout: BlockLayout | None = None,
                 map_size: int | None = None, queue_blocks: int = 256, batch_blocks: int = 32,
                 readonly: bool = False, decode_threads: int | None = None, encode_threads: int | None = None,
                 reserve_bytes: int | None = DEFAULT_RESERVE_BYTES, encode_process: str | None = "auto",
                 stall_s: float = DEFAULT_STALL_S, seal: DiskSeal | None = None) -> None:
        for name, v in (("capacity_bytes", capacity_bytes), ("queue_blocks", queue_blocks),
                        ("batch_blocks", batch_blocks), ("map_size", map_size), ("decode_threads", decode_threads),
                        ("encode_threads", encode_threads)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if reserve_bytes is not None and (isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int)
                                          or reserve_bytes < 0):
            raise ValueError(f"reserve_bytes: expected an int >= 0 or None, got {reserve_bytes!r}")
        keep_freed_memory()     # block-sized buffers by the thousand: no page faults each time
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.layout = layout
        self.readonly = readonly
        self._decode_threads = decode_threads or os.cpu_count() or 1
        if readonly and not os.path.isfile(os.path.join(self.path, "data.mdb")):
            raise FileNotFoundError(f"{self.path} holds no disk tier (no data.mdb)")
        recovered: str | None = None             # a damaged store moved aside at open: where, and why
        self._map_size = map_size or default_map_size(capacity_bytes)
        if readonly:
            env, dbs = open_env(self.path, self._map_size, readonly=True)   # damage: raises
            hashes = None
        else:
            # A damaged store is moved aside here; a full filesystem or a directory this process
            # cannot write raises DiskUnavailable before LMDB maps anything (no tier, a server).
            opened = open_writable(self.path, self._map_size, capacity_bytes)
            env, dbs, hashes, recovered = opened.env, opened.dbs, opened.hashes, opened.recovered
        self._gate = EnvGate(env, dbs, self.path, stall_s)   # NOTE: every transaction goes through it
        self._begin = self._gate.begin
        self._seal = seal        # a shared directory's records sealed under the fleet secret (storage/disk/seal.py)
        try:
            settle(self.path, seal, self._begin, lambda: self._gate.dbs, readonly)
        except BaseException:
            self._gate.close()
            raise
        self._closed = False
        self._stats_lock = threading.Lock()
        self._counters = _Counters(moved_aside=int(recovered is not None))
        self._last_read_error_log = -1e9
        self._last_info = (StoreInfo(), capacity_bytes)
        self._read_info()
        self._pool: ThreadPoolExecutor | None = None
        # Every stored hash, read once at open: contains() is asked for every block of every
        # waiting request on every engine step, and must not read LMDB each time.
        self._iter_db = self._gate.iter_db
        self._index = DiskIndex(hashes if hashes is not None else (h for h, _ in self._iter_db("meta", values=False)))
        # Built readonly too (nothing pending, ever), but its thread runs only for a writer.
        self._writer = DiskWriter(self._gate, codec, capacity_bytes, queue_blocks, batch_blocks, self._count,
                                  self._index, reserve_bytes, self._map_size, encode_threads,
                                  encode_process_policy() if encode_process == "auto" else encode_process)
        self._writer.seal = seal
        self._replacement = StoreReplacement(self.path, self._map_size, capacity_bytes, self._gate, self._index,
                                             self._count, lambda: self._counters.moved_aside, recovered)
        if not readonly:
            self._gate.on_damage = self._replacement.damaged
            self._writer.on_tick = self._replacement.tick
            self._writer.on_info = self._committed
            self._writer.start()

    @property
    def sealed_by(self) -> bytes | None:
        """The key id of the fleet secret this store's records are sealed under, or None."""
        with self._begin() as txn:
            return load_sealed(txn, self._dbs)

    @property
    def recovered(self) -> str | None:
        """The last damaged store moved aside (at open or while serving): where, and why."""
        return self._replacement.recovered

    # The environment and its database handles are the gate's: a damaged store is replaced under
    # it. NOTE: use the handles inside a transaction only (a replacement waits for none open).
    @property
    def _env(self):
        return self._gate.env

    @property
    def _dbs(self):
        return self._gate.dbs

    @property
    def _payload(self):
        return self._gate.dbs.payload

    @property
    def _meta(self):
        return self._gate.dbs.meta

    @property
    def _lru(self):
        return self._gate.dbs.lru

    # -- public API ----------------------------------------------------------------------

    kind = DISK
    name = DISK.name
    local = DISK.local    # contains() answers from the index: a LowerTier needing no probe

    def put(self, key: BlockKey, block: torch.Tensor | None = None, *, wait: bool = True, timeout: float | None = None,
            payload: bytes | None = None, raw_size: int = 0, owned: bool = False) -> bool:
        """Queue `block` for the background writer and return without compressing.

        The block's bytes are copied to CPU before returning, so the caller may reuse its
        memory at once -- unless `owned` (LowerTier.put: the caller's private copy, kept). Skipped when the hash is already stored or pending. The queue is
        bounded (queue_blocks): when it is full, put waits until the writer catches up
        (backpressure, up to `timeout`); with wait=False it never waits, may fill the queue to twice its bound,
        and past that returns False (counted in stats().queue_full_drops): the engine's
        eviction cascade must never wait on the disk.
        Write failures are never raised here: see stats().write_errors.
        `payload`: the block already encoded by this tier's codec format and bound to its hash and
        namespace (a block the remote tier just read and verified; `raw_size` its decoded bytes,
        or `block`'s): the writer stores it as is instead of compressing the block again, and
        `block` is not copied (a read while it waits decodes the payload).
        """
        self._check_open(write=True)
        if block is None and payload is None:
            raise ValueError("put: give the block, or its encoded payload")
        if self._gate.down is not None:
            self._writer.lost(1)             # the tier is off (stats().unavailable): a lost write, counted
            return False
        if self._writer.writes_off is not None or self._gate.stall.reason() is not None:
            self._count(writes_off_drops=1)  # its directory takes no writes, or stalls (stats().writes_off): not queued
            return False
        if block is not None:
            dtype_name(block.dtype)
            if self.layout is not None and (tuple(block.shape) != self.layout.shape or block.dtype != self.layout.dtype):
                raise ValueError(f"block: expected shape {self.layout.shape} of {self.layout.dtype}, "
                                 f"got {tuple(block.shape)} of {block.dtype}")
        if self._writer.is_pending(key.hash) or key.hash in self._index:
            return True
        if payload is not None:
            copy = None
            raw_size = block.numel() * block.element_size() if block is not None else raw_size
        else:
            copy, raw_size = owned_or_copied(block, owned), 0
        if self._writer.submit(key, copy, wait, payload, raw_size, timeout):   # waits while the queue is full, if wait
            return True
        self._count(queue_full_drops=1)
        return False

    @property
    def events(self):
        """The KV-event hook (storage/kv_events/sink.py): the index says every change (DISK)."""
        return self._index.events

    @events.setter
    def events(self, sink) -> None:
        self._index.events = sink

    def announce(self, keys: Sequence[BlockKey]) -> None:
        """A KV event (BlockStored DISK) for each of these blocks the tier still holds: the blocks
        found at open, read back by iter_blocks (storage/tiered_cache.py announces them)."""
        self._index.announce(keys)

    def on_commit(self, callback) -> bool:
        """Have the writer thread call `callback([(key, payload, raw_size), ...])` after each
        commit, with the blocks it stored (the remote tier's write-behind). It must not block
        for long: the next commit waits for it."""
        self._writer.on_commit = callback
        return True

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block until the writer's queue is below its bound: what a caller that may wait (and
        holds no lock) does between batches of cascade puts, so they are never dropped."""
        return self.readonly or self._closed or self._writer.wait_for_room(timeout)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block is pending or (as far as this process knows: storage/disk/index.py)
        stored. Reads no LMDB: answered from memory."""
        self._check_open()
        if self._gate.stall.reason(reads=True) is not None:
            return False                     # stalled: a read would be a miss (storage/disk/stall.py)
        return self._writer.is_pending(key.hash) or key.hash in self._index

    def delete(self, key: BlockKey) -> bool:
        """Remove a block (pending or stored). True when there was one."""
        self._check_open(write=True)
        was_pending = self._writer.cancel(key.hash)
        return self._delete_now([key.hash]) > 0 or was_pending

    def clear(self) -> int:
        """Delete every block, pending ones included. Returns how many stored blocks went."""
        self._check_open(write=True)
        self._writer.cancel_all()
        with self._begin(write=True) as txn:
            info = load_info(txn, self._dbs)
            n = txn.stat(self._meta)["entries"]
            for db in (self._payload, self._meta, self._lru):
                txn.drop(db, delete=False)
            store_info(txn, self._dbs, StoreInfo(next_seq=info.next_seq))
        self._index.clear()
        return n

    def drain(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Block until every queued put and access update is committed (including those other
        threads add meanwhile). False on timeout, if the writer thread is gone, or if any block
        was dropped (no room even after evicting, an I/O error) while it waited -- or since
        `since`, a write_failures() mark: the dropped blocks are counted in stats().write_errors."""
        if self.readonly or self._closed:
            return True
        return self._writer.drain(timeout, since)

    def write_failures(self) -> int:
        """A mark for drain(since=...): taken before queueing puts, a drain then also sees a block
        the writer dropped before the drain began waiting."""
        return self._writer.dropped()

    def close(self) -> None:
        """Drain, stop the writer, close the environment. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._writer.stop()
        self._writer.join()        # before _stopping: its last commits still need transactions
        self._read_info()
        self._gate.close()         # waits for every open transaction, then unmaps
        if self._pool is not None:
            self._pool.shutdown()
        self._closed = True

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> DiskStats:
        info, capacity = self._last_info if self._closed else self._read_info(_STATUS_WAIT_S)
        with self._stats_lock:
            c = _Counters(**{f: getattr(self._counters, f) for f in _Counters.__slots__})
        pending = self._writer.pending_count()
        return DiskStats(capacity_bytes=capacity, used_bytes=info.used_bytes, raw_bytes=info.raw_bytes,
                         blocks=info.blocks,
                         compression_ratio=info.raw_bytes / info.used_bytes if info.used_bytes else 0.0,
                         store_hits=c.store_hits, misses=c.misses, corrupt=c.corrupt, evictions=c.evictions,
                         bytes_read=c.bytes_read, bytes_written=c.bytes_written, write_errors=c.write_errors,
                         read_errors=c.read_errors, pending_writes=pending, recovered=self.recovered,
                         queue_full_drops=c.queue_full_drops, moved_aside=c.moved_aside,
                         writes_off=self._writer.writes_off or self._gate.stall.reason(),
                         writes_off_drops=c.writes_off_drops,
                         unavailable=self._gate.down, free_bytes=self._writer.space[0],
                         space_bound_bytes=self._writer.space[1], encode_process=self._writer.encode_process_stats())

    def verify(self, repair: bool = False) -> VerifyReport:
        """Check what open and the writer rely on, then every block.

        The store: every page pointer, overflow header and free-page list (the page walk), and
        the `info` counters and LRU index against a recount (check()). Every block: header and
        checksum (full decode), sizes, LRU entry, and the hash chain (hash == hash_block(parent,
        token_ids)). repair=True moves a store with damaged pages aside (a fresh one in its
        place: nothing in it can be trusted), recounts wrong counters and rebuilds the LRU
        index, and deletes damaged blocks."""
        self._check_open(write=repair)
        verifiable(self.path, self._seal, self._begin, lambda: self._dbs)
        generation = self._gate.generation
        try:
            check_pages(self._env, self.path, self._begin)
        except DamagedEnvironment as e:
            # NOTE: no block is read through a damaged page pointer (it may SIGBUS).
            done: tuple[str, ...] = ()
            if repair:
                self._replacement.damaged(e, generation)
                done = (f"store {self.recovered}",)
            return VerifyReport(0, (), 0, (str(e),), done)
        store = tuple(self.check())
        store_done: tuple[str, ...] = ()
        if repair and store:
            with self._begin(write=True) as txn:
                hashes, fixed = repair_counters(txn, self._dbs)
            self._index.replace(hashes)
            store_done = tuple(fixed) or ("counters rewritten",)
        report = verify_store(self._begin, self._iter_db, lambda: self._dbs, self._executor(), self.codec, self.layout,
                              self._seal)
        repaired = 0
        if repair and report.damaged:
            repaired = self._delete_now([d.key for d in report.damaged], recount=True)
        return VerifyReport(report.checked, report.damaged, repaired, store, store_done)

    def check(self) -> list[str]:
        """Audit: recompute every counter and index from the databases and compare.
        Returns the problems found (empty when consistent)."""
        self._check_open()
        return audit(self._begin, lambda: self._dbs, self._store_capacity())

    # -- internals: reading --------------------------------------------------------------

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise RuntimeError("DiskTier is closed")
        if write and self.readonly:
            raise RuntimeError(f"DiskTier {self.path} was opened readonly")

    # -- internals: info, direct deletes, counters -----------------------------------------

    def _store_capacity(self) -> int:
        return self._read_info()[1]

    def _read_info(self, wait: float | None = None) -> tuple[StoreInfo, int]:
        """The store's counters and capacity; empty while the tier has no store, the last ones read
        when this read fails or the store does not answer within `wait` s (None: no bound but the
        stall watch's) (stats() never raises nor waits on a stalled filesystem: /ready, /metrics and status read
        it; damage found here is reported by the gate and the store replaced, as for any read)."""
        try:
            with self._begin(bounded=wait) as txn:
                self._last_info = load_info(txn, self._dbs), load_capacity(txn, self._dbs) or self.capacity_bytes
        except DiskStalled:
            pass
        except DiskUnavailable:
            return StoreInfo(), self.capacity_bytes
        except Exception as e:      # noqa: BLE001 -- lmdb.Error, OSError, damage: a state, not a 500
            self._read_failed("reading its counters", e)
        return self._last_info

    def _committed(self, info: StoreInfo, capacity: int) -> None:
        self._last_info = info, capacity        # (the writer's thread: one assignment)

    def _delete_now(self, hashes: Iterable[bytes], recount: bool = False) -> int:
        """Delete blocks in a short write transaction of the calling thread. Returns how many."""
        try:
            hashes = list(hashes)
            with self._begin(write=True) as txn:
                info = load_info(txn, self._dbs)
                n = sum(delete_in_txn(txn, self._dbs, h, info) for h in hashes)
                if recount:
                    recount_info(txn, self._dbs, info)
                store_info(txn, self._dbs, info)
            self._index.discard(hashes)
            return n
        except Exception:
            log.exception("disk tier: deleting blocks failed")
            return 0

    def _read_failed(self, what: str, e: BaseException, misses: int = 0) -> None:
        self._count(read_errors=1, misses=misses)
        now = time.monotonic()
        with self._stats_lock:      # one line per 10 s: a failing store is read on every lookup
            if now - self._last_read_error_log < 10:
                return
            self._last_read_error_log = now
        log.error("disk tier %s: %s failed (%s: %s): served as a miss (read_errors=%d)", self.path, what,
                  type(e).__name__, e, self._counters.read_errors)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._counters, k, getattr(self._counters, k) + v)

