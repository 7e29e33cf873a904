"""The disk tier: compressed KV blocks in an LMDB environment, with an LRU capacity bound.

Knows: the on-disk layout (four named LMDB databases, below), the background writer that
compresses and commits blocks in batches, LRU eviction by stored bytes, and how to verify a
block before serving it (codec checksum, stored token ids / namespace / parent, layout).
Doesn't know: the other tiers, models, or when a block should be demoted (storage/kv_cache).

Databases in the environment directory:

    payload  hash -> codec payload (storage/codec.py)
    meta     hash -> _Meta (parent, namespace, token ids, sizes, created, last access seq, hits)
    lru      8-byte big-endian access sequence || hash -> b""   (key order == LRU order)
    info     b"counters" -> used bytes, blocks, raw bytes, next sequence; b"format" -> version

Every counter that defines capacity lives in `info` and changes in the same write
transaction as the blocks it counts, so several processes sharing one directory keep them
right (LMDB serializes writers across processes). LMDB commits are atomic, so the directory
opens after a crash at the last committed state; the index is the `meta` database, so
opening scans nothing. Processes sharing a directory should pass the same capacity (and
map_size): the capacity bound is enforced by whichever process writes.

Hits/misses/corrupt/evictions/bytes counters in `stats()` are this process's own.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import lmdb
import torch

from storage.codec import Codec, CodecError
from storage.layout import BlockLayout, dtype_name
from tieredkv.hashing import BlockKey, hash_block

log = logging.getLogger(__name__)

DISK_FORMAT_VERSION = 1
_MAP_FLOOR = 1 << 30
_CHUNK = 512                     # keys per read transaction when iterating the whole store
_SEQ = struct.Struct(">Q")       # big-endian so LMDB's byte order is numeric order
_U64 = struct.Struct("<Q")
_COUNTERS = struct.Struct("<QQQQ")
_META_FIXED = struct.Struct("<B32sQQdQQHI")
_META_VERSION = 1


def default_map_size(capacity_bytes: int) -> int:
    """LMDB's address-space reservation: a generous multiple of the capacity (the file is
    sparse and grows only as pages are written), with a floor for small capacities. Page
    rounding of values and copy-on-write pages need room beyond the payload bytes."""
    return max(4 * capacity_bytes, _MAP_FLOOR)


@dataclass(slots=True)
class _Meta:
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    raw_size: int
    stored_size: int
    created: float
    last_access: int
    hits: int

    def pack(self) -> bytes:
        return (_META_FIXED.pack(_META_VERSION, self.parent, self.raw_size, self.stored_size, self.created,
                                 self.last_access, self.hits, len(self.namespace), len(self.token_ids))
                + self.namespace + struct.pack(f"<{len(self.token_ids)}I", *self.token_ids))

    @staticmethod
    def unpack(buf: bytes | memoryview) -> "_Meta":
        """Raises ValueError for a damaged record."""
        try:
            v, parent, raw, stored, created, last, hits, ns_len, n_tok = _META_FIXED.unpack_from(buf, 0)
        except struct.error as e:
            raise ValueError(f"metadata record damaged: {e}") from None
        if v != _META_VERSION or len(buf) != _META_FIXED.size + ns_len + 4 * n_tok:
            raise ValueError("metadata record damaged: bad version or length")
        ns = bytes(buf[_META_FIXED.size:_META_FIXED.size + ns_len])
        toks = struct.unpack_from(f"<{n_tok}I", buf, _META_FIXED.size + ns_len)
        return _Meta(parent, ns, toks, raw, stored, created, last, hits)


@dataclass(slots=True)
class _Info:
    used_bytes: int = 0
    blocks: int = 0
    raw_bytes: int = 0
    next_seq: int = 1


@dataclass(frozen=True, slots=True)
class DiskStats:
    capacity_bytes: int
    used_bytes: int
    raw_bytes: int
    blocks: int
    compression_ratio: float
    hits: int
    misses: int
    corrupt: int
    evictions: int
    bytes_read: int
    bytes_written: int
    write_errors: int
    pending_writes: int


@dataclass(frozen=True, slots=True)
class DiskBlockInfo:
    hash: bytes
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    raw_size: int
    stored_size: int
    hits: int
    last_access: int
    created: float


@dataclass(frozen=True, slots=True)
class DamagedBlock:
    hash: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int
    damaged: tuple[DamagedBlock, ...]
    repaired: int


@dataclass(slots=True)
class _Pending:
    key: BlockKey
    block: torch.Tensor


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0


def _is_no_space(e: BaseException) -> bool:
    # lmdb.DiskError is LMDB's ENOSPC; an OSError may carry it too.
    return isinstance(e, (lmdb.MapFullError, lmdb.DiskError)) or getattr(e, "errno", None) == errno.ENOSPC


class DiskTier:
    """Blocks on disk, LRU-bounded by stored (compressed) bytes. Thread-safe.

    put() hands a block to a background writer thread; get()/get_many() verify before
    serving; a block that fails verification is counted as corrupt, deleted, and missed.
    readonly=True opens for inspection next to a running writer (no writer thread; get()
    neither records accesses nor deletes damaged blocks).
    """

    def __init__(self, path: str, capacity_bytes: int, codec: Codec = Codec(), *, layout: BlockLayout | None = None,
                 map_size: int | None = None, queue_blocks: int = 256, batch_blocks: int = 32,
                 readonly: bool = False, decode_threads: int | None = None) -> None:
        for name, v in (("capacity_bytes", capacity_bytes), ("queue_blocks", queue_blocks),
                        ("batch_blocks", batch_blocks), ("map_size", map_size), ("decode_threads", decode_threads)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.layout = layout
        self.readonly = readonly
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._decode_threads = decode_threads or os.cpu_count() or 1
        if readonly and not os.path.isfile(os.path.join(self.path, "data.mdb")):
            raise FileNotFoundError(f"{self.path} holds no disk tier (no data.mdb)")
        os.makedirs(self.path, exist_ok=True)
        # lock=True (the default) is what lets several processes share the directory.
        self._env = lmdb.open(self.path, map_size=map_size or default_map_size(capacity_bytes), max_dbs=4,
                              readonly=readonly, readahead=False, max_readers=512)
        try:
            self._open_dbs()
        except BaseException:
            self._env.close()
            raise
        self._cond = threading.Condition()
        self._pending: dict[bytes, _Pending] = {}   # every put not yet committed (queued or in flight)
        self._queue: deque[bytes] = deque()         # pending hashes the writer has not taken yet
        self._touches: dict[bytes, int] = {}        # hash -> hits to record, in access order
        self._cancelled: set[bytes] = set()         # deleted while in the writer's hands
        self._busy = False
        self._stopping = False
        self._readers = 0                           # get_many calls reading the map in place
        self._closed = False
        self._stats_lock = threading.Lock()
        self._counters = _Counters()
        self._last_info = self._read_info()
        self._pool: ThreadPoolExecutor | None = None
        self._writer: threading.Thread | None = None
        if not readonly:
            self._writer = threading.Thread(target=self._writer_loop, name="tieredkv-disk-writer", daemon=True)
            self._writer.start()

    def _open_dbs(self) -> None:
        if self.readonly:
            try:
                self._payload, self._meta, self._lru, self._info = (
                    self._env.open_db(n, create=False) for n in (b"payload", b"meta", b"lru", b"info"))
            except lmdb.NotFoundError:
                raise FileNotFoundError(f"{self.path} is not a tieredkv disk tier (databases missing)") from None
            with self._env.begin() as txn:
                self._check_format(txn.get(b"format", db=self._info))
            return
        with self._env.begin(write=True) as txn:
            self._payload, self._meta, self._lru, self._info = (
                self._env.open_db(n, txn=txn) for n in (b"payload", b"meta", b"lru", b"info"))
            fmt = txn.get(b"format", db=self._info)
            if fmt is None:
                txn.put(b"format", _U64.pack(DISK_FORMAT_VERSION), db=self._info)
                self._store_info(txn, _Info())
            self._check_format(fmt)

    def _check_format(self, fmt: bytes | None) -> None:
        if fmt is not None and _U64.unpack(fmt)[0] != DISK_FORMAT_VERSION:
            raise ValueError(f"disk tier {self.path}: format version {_U64.unpack(fmt)[0]}, this build reads "
                             f"{DISK_FORMAT_VERSION}; point disk_dir elsewhere or delete the directory")

    # -- info counters -------------------------------------------------------------------

    def _load_info(self, txn: lmdb.Transaction) -> _Info:
        raw = txn.get(b"counters", db=self._info)
        return _Info() if raw is None else _Info(*_COUNTERS.unpack(raw))

    def _store_info(self, txn: lmdb.Transaction, info: _Info) -> None:
        txn.put(b"counters", _COUNTERS.pack(info.used_bytes, info.blocks, info.raw_bytes, info.next_seq),
                db=self._info)

    def _read_info(self) -> _Info:
        with self._env.begin() as txn:
            return self._load_info(txn)

    # -- public API ----------------------------------------------------------------------

    def put(self, key: BlockKey, block: torch.Tensor) -> None:
        """Queue `block` for the background writer and return without compressing.

        The block's bytes are copied to CPU before returning, so the caller may reuse its
        memory at once. Skipped when the hash is already stored or pending. The queue is
        bounded (queue_blocks): when it is full, put blocks until the writer catches up
        (backpressure). Write failures are never raised here: see stats().write_errors.
        """
        self._check_open(write=True)
        dtype_name(block.dtype)
        if self.layout is not None and (tuple(block.shape) != self.layout.shape or block.dtype != self.layout.dtype):
            raise ValueError(f"block: expected shape {self.layout.shape} of {self.layout.dtype}, "
                             f"got {tuple(block.shape)} of {block.dtype}")
        h = key.hash
        with self._cond:
            if h in self._pending:
                return
        if self._stored(h):
            return
        copy = torch.empty(block.shape, dtype=block.dtype)
        copy.copy_(block.detach())
        with self._cond:
            # NOTE: the queue bound -- put waits here while queue_blocks blocks are pending.
            while len(self._pending) >= self._queue_blocks and not self._stopping:
                self._cond.wait()
            if self._stopping:
                raise RuntimeError("DiskTier is closed")
            if h not in self._pending:
                self._pending[h] = _Pending(key, copy)
                self._queue.append(h)
                self._cond.notify_all()

    def contains(self, h: bytes) -> bool:
        self._check_open()
        with self._cond:
            if h in self._pending:
                return True
        return self._stored(h)

    def get(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The verified block for `key`, or None (missing, or damaged: then counted and deleted).

        `out`, when given, receives the bytes (contiguous CPU, the block's dtype and numel);
        a stored block that does not fit it is treated as corrupt.
        """
        return self.get_many([key], None if out is None else [out])[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor | None]:
        """get() for many keys: payloads read in one read transaction, decoded in parallel
        (zstd releases the GIL, so a disk restore uses every decode thread)."""
        self._check_open()
        keys = list(keys)
        outs = [None] * len(keys) if outs is None else list(outs)
        if len(outs) != len(keys):
            raise ValueError(f"outs: expected {len(keys)} entries, got {len(outs)}")
        results: list[torch.Tensor | None] = [None] * len(keys)
        with self._cond:
            pending = [self._pending.get(k.hash) for k in keys]
        todo, misses, hits = [], 0, 0
        # NOTE: buffers=True reads payloads in place from the map: no copy into fresh memory per
        # block (~8-10% of a get_many, tools/bench_tiers.py). They are valid only inside the
        # transaction, so decoding happens inside it too; decoded tensors never alias them, and
        # close() waits for _reading() so the map is never unmapped under a decode.
        with self._reading(), self._env.begin(buffers=True) as txn:
            for i, (key, p) in enumerate(zip(keys, pending)):
                if p is not None:
                    # Served from the raw copy awaiting the writer; a key or `out` that does
                    # not match it is a miss (nothing stored is damaged).
                    results[i] = _pending_copy(p, key, outs[i])
                    hits, misses = hits + (results[i] is not None), misses + (results[i] is None)
                    continue
                payload, meta = txn.get(key.hash, db=self._payload), txn.get(key.hash, db=self._meta)
                if payload is None and meta is None:
                    misses += 1
                else:
                    todo.append((i, key, outs[i], payload, meta))
            if len(todo) > 1 and self._decode_threads > 1:
                checked = list(self._executor().map(self._verify_and_decode, todo))
            else:
                checked = [self._verify_and_decode(t) for t in todo]
            sizes = [0 if payload is None else len(payload) for _, _, _, payload, _ in todo]
        damaged, touched, bytes_read = [], [], 0
        for (i, key, _, _, _), size, (tensor, reason) in zip(todo, sizes, checked):
            if tensor is None:
                log.warning("disk tier: block %s is damaged (%s): a miss", key.hash.hex()[:16], reason)
                damaged.append(key.hash)
            else:
                results[i] = tensor
                touched.append(key.hash)
                bytes_read += size
        with self._stats_lock:
            c = self._counters
            c.hits += hits + len(touched)
            c.misses += misses
            c.corrupt += len(damaged)
            c.bytes_read += bytes_read
        if damaged and not self.readonly:
            self._delete_now(damaged)
        if touched and not self.readonly:
            with self._cond:
                for h in touched:
                    # NOTE: reads never take LMDB's write lock: accesses are recorded by the writer.
                    self._touches[h] = self._touches.pop(h, 0) + 1
                self._cond.notify_all()
        return results

    def delete(self, h: bytes) -> bool:
        """Remove a block (pending or stored). True when there was one."""
        self._check_open(write=True)
        with self._cond:
            p = self._pending.pop(h, None)
            if p is not None:
                if h in self._queue:
                    self._queue.remove(h)
                else:
                    self._cancelled.add(h)   # the writer has it: it checks this inside its txn
                self._cond.notify_all()
        return self._delete_now([h]) > 0 or p is not None

    def clear(self) -> int:
        """Delete every block, pending ones included. Returns how many stored blocks went."""
        self._check_open(write=True)
        with self._cond:
            for h in self._pending:
                if h not in self._queue:
                    self._cancelled.add(h)
            self._pending.clear()
            self._queue.clear()
            self._cond.notify_all()
        with self._env.begin(write=True) as txn:
            info = self._load_info(txn)
            n = txn.stat(self._meta)["entries"]
            for db in (self._payload, self._meta, self._lru):
                txn.drop(db, delete=False)
            self._store_info(txn, _Info(next_seq=info.next_seq))
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued put and access update is committed (including those other
        threads add meanwhile). False on timeout, or if the writer thread is gone."""
        if self.readonly or self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._touches or self._busy:
                if self._writer is None or not self._writer.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Flush, stop the writer, close the environment. Idempotent."""
        if self._closed:
            return
        self.flush()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            while self._readers:   # NOTE: never unmap the environment under a get_many's decode
                self._cond.wait()
        if self._writer is not None:
            self._writer.join()
        if self._pool is not None:
            self._pool.shutdown()
        self._last_info = self._read_info()
        self._closed = True
        self._env.close()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> DiskStats:
        info = self._last_info if self._closed else self._read_info()
        with self._stats_lock:
            c = _Counters(**{f: getattr(self._counters, f) for f in _Counters.__slots__})
        with self._cond:
            pending = len(self._pending)
        return DiskStats(capacity_bytes=self.capacity_bytes, used_bytes=info.used_bytes, raw_bytes=info.raw_bytes,
                         blocks=info.blocks,
                         compression_ratio=info.raw_bytes / info.used_bytes if info.used_bytes else 0.0,
                         hits=c.hits, misses=c.misses, corrupt=c.corrupt, evictions=c.evictions,
                         bytes_read=c.bytes_read, bytes_written=c.bytes_written, write_errors=c.write_errors,
                         pending_writes=pending)

    def iter_blocks(self) -> Iterator[DiskBlockInfo]:
        """Every stored block's metadata, in hash order (undecodable records are skipped:
        verify() reports them). Reads in chunks, so no read transaction stays open long."""
        self._check_open()
        for h, raw in self._iter_db(self._meta):
            try:
                m = _Meta.unpack(raw)
            except ValueError:
                continue
            yield DiskBlockInfo(h, m.parent, m.namespace, m.token_ids, m.raw_size, m.stored_size, m.hits,
                                m.last_access, m.created)

    def verify(self, repair: bool = False) -> VerifyReport:
        """Check every block: header and checksum (full decode), sizes, LRU entry, and the
        hash chain (hash == hash_block(parent, token_ids)). repair=True deletes damaged blocks
        and recomputes the counters."""
        self._check_open(write=repair)
        hashes = sorted({h for h, _ in self._iter_db(self._payload, values=False)}
                        | {h for h, _ in self._iter_db(self._meta, values=False)})
        damaged: list[DamagedBlock] = []
        for start in range(0, len(hashes), _CHUNK):
            chunk = hashes[start:start + _CHUNK]
            with self._env.begin() as txn:
                rows = [(h, txn.get(h, db=self._payload), txn.get(h, db=self._meta)) for h in chunk]
                lru_ok = {}
                for h, _, meta in rows:
                    try:
                        lru_ok[h] = txn.get(_SEQ.pack(_Meta.unpack(meta).last_access) + h, db=self._lru) is not None
                    except (ValueError, TypeError):
                        lru_ok[h] = True   # reported by _check_block
            for (h, payload, meta), reason in zip(rows, self._executor().map(lambda r: _check_block(self, *r), rows)):
                if reason is None and not lru_ok[h]:
                    reason = "LRU entry missing"
                if reason is not None:
                    damaged.append(DamagedBlock(h, reason))
        repaired = 0
        if repair and damaged:
            repaired = self._delete_now([d.hash for d in damaged], recount=True)
        return VerifyReport(checked=len(hashes), damaged=tuple(damaged), repaired=repaired)

    def check(self) -> list[str]:
        """Audit: recompute every counter and index from the databases and compare.
        Returns the problems found (empty when consistent)."""
        self._check_open()
        problems: list[str] = []
        with self._env.begin() as txn:
            info = self._load_info(txn)
            used = raw = blocks = 0
            max_seq = 0
            for h, v in txn.cursor(db=self._meta):
                try:
                    m = _Meta.unpack(v)
                except ValueError as e:
                    problems.append(f"{h.hex()[:16]}: {e}")
                    continue
                blocks += 1
                used += m.stored_size
                raw += m.raw_size
                max_seq = max(max_seq, m.last_access)
                p = txn.get(h, db=self._payload)
                if p is None or len(p) != m.stored_size:
                    problems.append(f"{h.hex()[:16]}: payload missing or size != {m.stored_size}")
                if txn.get(_SEQ.pack(m.last_access) + h, db=self._lru) is None:
                    problems.append(f"{h.hex()[:16]}: LRU entry missing")
            n_payload = txn.stat(self._payload)["entries"]
            n_lru = txn.stat(self._lru)["entries"]
        for name, want, got in (("used_bytes", used, info.used_bytes), ("raw_bytes", raw, info.raw_bytes),
                                ("blocks", blocks, info.blocks), ("payload entries", blocks, n_payload),
                                ("lru entries", blocks, n_lru)):
            if want != got:
                problems.append(f"{name}: counted {want}, recorded {got}")
        if info.next_seq <= max_seq:
            problems.append(f"next_seq {info.next_seq} <= a used sequence {max_seq}")
        if info.used_bytes > self.capacity_bytes:
            problems.append(f"used_bytes {info.used_bytes} > capacity {self.capacity_bytes}")
        return problems

    # -- internals: reading --------------------------------------------------------------

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise RuntimeError("DiskTier is closed")
        if write and self.readonly:
            raise RuntimeError(f"DiskTier {self.path} was opened readonly")

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A read that holds views into the map: close() waits for it before closing."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("DiskTier is closed")
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def _stored(self, h: bytes) -> bool:
        with self._env.begin() as txn:
            return txn.get(h, db=self._meta) is not None

    def _executor(self) -> ThreadPoolExecutor:
        with self._stats_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._decode_threads, thread_name_prefix="tieredkv-disk-decode")
            return self._pool

    def _iter_db(self, db: object, values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        last = None
        while True:
            with self._env.begin() as txn:
                cur = txn.cursor(db=db)
                ok = cur.first() if last is None else cur.set_range(last + b"\x00")
                rows = []
                while ok and len(rows) < _CHUNK:
                    rows.append((cur.key(), cur.value() if values else None))
                    ok = cur.next()
            yield from rows
            if not ok:
                return
            last = rows[-1][0]

    def _verify_and_decode(self, item: tuple) -> tuple[torch.Tensor | None, str | None]:
        _, key, out, payload, meta_raw = item
        if payload is None or meta_raw is None:
            return None, "payload missing" if payload is None else "metadata missing"
        try:
            m = _Meta.unpack(meta_raw)
        except ValueError as e:
            return None, str(e)
        if m.token_ids != key.token_ids:
            return None, "stored token ids differ from the key's"
        if m.namespace != key.namespace:
            return None, "stored namespace differs from the key's"
        if m.parent != key.parent:
            return None, "stored parent differs from the key's"
        if m.stored_size != len(payload):
            return None, f"payload is {len(payload)} bytes, metadata says {m.stored_size}"
        try:
            header = self.codec.peek_header(payload)
            if header.raw_size != m.raw_size:
                return None, f"header raw size {header.raw_size} != metadata's {m.raw_size}"
            if self.layout is not None and (header.dtype != dtype_name(self.layout.dtype)
                                            or header.shape != self.layout.shape):
                return None, f"block is {header.shape} {header.dtype}, layout wants {self.layout.shape}"
            if out is not None and (dtype_name(out.dtype) != header.dtype or out.numel() != header.numel):
                return None, f"block is {header.shape} {header.dtype}, does not fit out"
            return self.codec.decode(payload, out), None
        except CodecError as e:
            return None, f"codec: {e}"

    # -- internals: writing (writer thread, plus direct deletes) ---------------------------

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._touches and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queue and not self._touches:
                    return
                n = min(self._batch_blocks, len(self._queue))
                items = [self._pending[self._queue.popleft()] for _ in range(n)]
                touches, self._touches = self._touches, {}
                self._busy = True
            try:
                self._write_batch(items, touches)
            except Exception:   # never let the writer die: the engine keeps running without disk writes
                log.exception("disk tier: writing a batch of %d blocks failed; dropping it", len(items))
                self._count(write_errors=len(items))
            finally:
                with self._cond:
                    for it in items:
                        if self._pending.get(it.key.hash) is it:
                            del self._pending[it.key.hash]
                        self._cancelled.discard(it.key.hash)
                    self._busy = False
                    self._cond.notify_all()

    def _write_batch(self, items: list[_Pending], touches: dict[bytes, int]) -> None:
        encoded = []
        for it in items:   # compress outside any transaction: the write lock is held only to commit
            try:
                encoded.append((it.key, self.codec.encode(it.block), it.block.numel() * it.block.element_size()))
            except Exception:
                log.exception("disk tier: encoding block %s failed", it.key.hash.hex()[:16])
                self._count(write_errors=1)
        if self._try_commit(encoded, touches):
            return
        if len(encoded) > 1:   # the batch does not fit as a whole: try each block alone
            for e in encoded:
                if not self._try_commit([e], {}):
                    self._count(write_errors=1)
        else:
            self._count(write_errors=len(encoded))

    def _try_commit(self, encoded: list, touches: dict[bytes, int]) -> bool:
        """Commit, making room on MapFull/ENOSPC; False when it still does not fit."""
        need = sum(len(p) for _, p, _ in encoded)
        for attempt in range(4):
            try:
                self._commit(encoded, touches)
                return True
            except Exception as e:
                if not _is_no_space(e):
                    raise
                log.warning("disk tier: %s; evicting to make room (attempt %d)", type(e).__name__, attempt + 1)
            # Free at least the batch or 10% of the store, more on each attempt. LMDB reuses freed
            # pages only once no transaction can still see them, hence several attempts.
            info = self._read_info()
            if self._make_room(max(need, info.used_bytes // 10) << attempt) == 0 and info.blocks == 0:
                break
        log.warning("disk tier: no room for %d block(s) after evicting; dropping them", len(encoded))
        return False

    def _commit(self, encoded: list, touches: dict[bytes, int]) -> None:
        written = evicted = 0
        with self._env.begin(write=True) as txn:
            info = self._load_info(txn)
            with self._cond:
                # NOTE: read inside the write txn, so a delete() either lands in this set or
                # starts its own write txn after this one commits (and then sees the block).
                cancelled = set(self._cancelled)
            for h, n in touches.items():   # accesses first: they happened before this batch's puts
                raw = txn.get(h, db=self._meta)
                try:
                    m = None if raw is None else _Meta.unpack(raw)
                except ValueError:
                    m = None   # damaged: the next get or verify() deletes it
                if m is None:
                    continue   # evicted or deleted since it was read
                txn.delete(_SEQ.pack(m.last_access) + h, db=self._lru)
                m.last_access, m.hits = info.next_seq, m.hits + n
                info.next_seq += 1
                txn.put(h, m.pack(), db=self._meta)
                txn.put(_SEQ.pack(m.last_access) + h, b"", db=self._lru)
            now = time.time()
            for key, payload, raw_size in encoded:
                h = key.hash
                if h in cancelled or txn.get(h, db=self._meta) is not None:
                    continue   # deleted meanwhile, or another process stored it first
                m = _Meta(key.parent, key.namespace, key.token_ids, raw_size, len(payload), now, info.next_seq, 0)
                info.next_seq += 1
                txn.put(h, payload, db=self._payload)
                txn.put(h, m.pack(), db=self._meta)
                txn.put(_SEQ.pack(m.last_access) + h, b"", db=self._lru)
                info.used_bytes += len(payload)
                info.raw_bytes += raw_size
                info.blocks += 1
                written += len(payload)
            # NOTE: the capacity invariant (used_bytes <= capacity_bytes) is enforced here, in the
            # same transaction that added the bytes: no committed state exceeds it, whichever
            # process committed it.
            evicted = self._evict_in_txn(txn, info, lambda: info.used_bytes > self.capacity_bytes)
            self._store_info(txn, info)
        self._count(bytes_written=written, evictions=evicted)

    def _make_room(self, target: int) -> int:
        """Evict LRU blocks until `target` stored bytes are freed, in a transaction of its own
        (smaller ones if even the deletes hit MapFull). Returns the bytes freed."""
        freed, per_txn = 0, 64
        while freed < target:
            try:
                with self._env.begin(write=True) as txn:
                    info = self._load_info(txn)
                    before, limit = info.used_bytes, [per_txn]

                    def more() -> bool:
                        limit[0] -= 1
                        return limit[0] >= 0 and before - info.used_bytes + freed < target
                    n = self._evict_in_txn(txn, info, more)
                    self._store_info(txn, info)
            except Exception as e:
                if not _is_no_space(e) or per_txn == 1:
                    raise
                per_txn = max(1, per_txn // 4)
                continue
            self._count(evictions=n)
            freed += before - info.used_bytes
            if n == 0:
                break
        # LMDB reuses a page freed by transaction N only from transaction N+2 on (N+1 may still
        # be read against N's snapshot), so commit one small transaction before the retry.
        try:
            with self._env.begin(write=True) as txn:
                self._store_info(txn, self._load_info(txn))
        except Exception as e:
            if not _is_no_space(e):
                raise
        return freed

    def _evict_in_txn(self, txn: lmdb.Transaction, info: _Info, more) -> int:
        n = 0
        while more():
            cur = txn.cursor(db=self._lru)
            if not cur.first():
                break
            h = cur.key()[_SEQ.size:]
            if self._delete_in_txn(txn, h, info):
                n += 1
            else:
                cur.delete()   # stray LRU entry without a block
        return n

    def _delete_in_txn(self, txn: lmdb.Transaction, h: bytes, info: _Info) -> bool:
        raw = txn.get(h, db=self._meta)
        try:
            m = None if raw is None else _Meta.unpack(raw)
        except ValueError:
            m = None
        if m is None:
            # No usable metadata: sizes and LRU position are unknown, so scan and recount (rare).
            found = txn.delete(h, db=self._payload) | txn.delete(h, db=self._meta)
            cur = txn.cursor(db=self._lru)
            stale = [k for k in cur.iternext(keys=True, values=False) if k[_SEQ.size:] == h]
            for k in stale:
                txn.delete(k, db=self._lru)
            self._recount(txn, info)
            return found or bool(stale)
        txn.delete(_SEQ.pack(m.last_access) + h, db=self._lru)
        txn.delete(h, db=self._meta)
        txn.delete(h, db=self._payload)
        info.used_bytes = max(0, info.used_bytes - m.stored_size)
        info.raw_bytes = max(0, info.raw_bytes - m.raw_size)
        info.blocks = max(0, info.blocks - 1)
        return True

    def _recount(self, txn: lmdb.Transaction, info: _Info) -> None:
        info.used_bytes = info.raw_bytes = info.blocks = 0
        for _, v in txn.cursor(db=self._meta):
            try:
                m = _Meta.unpack(v)
            except ValueError:
                continue
            info.used_bytes += m.stored_size
            info.raw_bytes += m.raw_size
            info.blocks += 1
            info.next_seq = max(info.next_seq, m.last_access + 1)

    def _delete_now(self, hashes: Iterable[bytes], recount: bool = False) -> int:
        """Delete blocks in a short write transaction of the calling thread. Returns how many."""
        try:
            with self._env.begin(write=True) as txn:
                info = self._load_info(txn)
                n = sum(self._delete_in_txn(txn, h, info) for h in hashes)
                if recount:
                    self._recount(txn, info)
                self._store_info(txn, info)
            return n
        except Exception:
            log.exception("disk tier: deleting blocks failed")
            return 0

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._counters, k, getattr(self._counters, k) + v)


def _pending_copy(p: _Pending, key: BlockKey, out: torch.Tensor | None) -> torch.Tensor | None:
    if (p.key.token_ids, p.key.namespace, p.key.parent) != (key.token_ids, key.namespace, key.parent):
        return None
    if out is None:
        return p.block.clone()
    if out.numel() != p.block.numel() or out.dtype != p.block.dtype or not out.is_contiguous():
        return None
    return out.view(p.block.shape).copy_(p.block)


def _check_block(tier: DiskTier, h: bytes, payload: bytes | None, meta: bytes | None) -> str | None:
    """verify()'s check of one stored block: None when sound, else the reason."""
    if payload is None or meta is None:
        return "payload missing" if payload is None else "metadata missing"
    try:
        m = _Meta.unpack(meta)
    except ValueError as e:
        return str(e)
    if hash_block(m.parent, m.token_ids) != h:
        return "hash chain broken: hash != hash_block(parent, token_ids)"
    key = BlockKey(h, m.parent, m.token_ids, m.namespace)
    _, reason = tier._verify_and_decode((0, key, None, payload, meta))
    return reason
