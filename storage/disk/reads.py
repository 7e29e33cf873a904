"""The disk tier's reads: verified blocks served from the store or from a put still pending,
read-ahead into the OS page cache, the stored blocks' metadata listed, and the decode pool.

Knows: one read transaction per get_many, each payload verified and decoded where it lies in the
map (on the decode pool, `tieredkv-disk-decode`, for zstd; the raw and nibble codecs' blocks by
compiled threads while the rest are fetched, storage/codec/block_batch.py), damaged blocks
counted and deleted, accesses handed to the writer (reads never take LMDB's write lock).
A part of DiskTier (a base class of it, as SharedPages is of the cache): the gate, the index, the
writer, the counters and `_delete_now`/`_read_failed` are DiskTier's (storage/disk/tier.py).
Doesn't know: writes, eviction, opening or replacing a store (writer.py, environment.py,
replacement.py), or the other tiers.

NOTE invariant: the read paths (get, get_many, read_ahead) never raise a storage error: an LMDB
or OS error while reading is a miss, counted in `read_errors` and logged (issue 7, item 2); a
stalled filesystem's (DiskStalled: storage/disk/stall.py) a miss at once, logged once by its watch.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import lmdb

from storage.codec import block_batch
from storage.codec.stored_block import BlockMeta, verify_and_decode
from storage.disk import map_faults
from storage.disk.preflight import DamagedEnvironment
from storage.disk.seal import SEAL_SIZE
from storage.disk.stall import DiskStalled
from storage.disk.stats import DiskBlockInfo
from storage.hashing import BlockKey
from storage.pool_drain import drain_on
from storage.priority import background_priority

if TYPE_CHECKING:      # blocks are tensors, but nothing here makes one: `tieredkv inspect`/`verify` load no torch
    import torch

log = logging.getLogger(__name__)


class DiskReads:
    def get(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The verified block for `key`, or None (missing, or damaged: then counted and deleted).

        `out`, when given, receives the bytes (contiguous CPU, the block's dtype and numel);
        a stored block that does not fit it is treated as corrupt.
        """
        return self.get_many([key], None if out is None else [out])[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None,
                 payloads: list | None = None, cancel: object = None) -> list[torch.Tensor | None]:
        """get() for many keys: payloads read in one read transaction, decoded in parallel
        (zstd releases the GIL, so a disk restore uses every decode thread). `payloads`, when given,
        receives each hit's stored payload (copied out of the map), None for a block served
        from a raw copy awaiting the writer. `cancel` is not honoured: a local read crosses no
        link and is bounded by the drive (storage/lower_tier.py)."""
        self._check_open()
        keys = list(keys)
        outs = [None] * len(keys) if outs is None else list(outs)
        if len(outs) != len(keys) or (payloads is not None and len(payloads) != len(keys)):
            raise ValueError(f"outs, payloads: expected {len(keys)} entries")
        try:
            return self._get_many(keys, outs, payloads)
        except DiskStalled:
            self._count(misses=len(keys))    # the filesystem is not answering: said once (storage/disk/stall.py)
            return [None] * len(keys)
        except (lmdb.Error, OSError, DamagedEnvironment) as e:
            # Nothing was served: a decode writes only into `outs`, which the caller does not
            # use for a miss. The whole call is one miss per key.
            self._read_failed("get_many", e, misses=len(keys))
            return [None] * len(keys)

    def _get_many(self, keys: list[BlockKey], outs: list[torch.Tensor | None], payloads: list | None
                  ) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(keys)
        pending = self._writer.pending(k.hash for k in keys)
        misses, hits = 0, 0
        gone: list[bytes] = []
        # The blocks read from the store, as parallel lists (no tuple per block: every object a
        # get_many keeps alive per block is one more for Python's collector to promote and walk,
        # and on a process holding a model a full collection costs tens of ms):
        idx: list[int] = []                       # each one's index in `keys`
        stored: list[memoryview | bytes | None] = []   # its payload: read in place, or copied out
        metas: list[memoryview | bytes | None] = []   # its metadata record: likewise
        # NOTE invariant: each payload is verified and decoded where it lies in the map, inside
        # the read transaction: the decode's copy into `out` is the one copy. A data.mdb
        # truncated under the server while a restore decodes reads as zeros there
        # (storage/disk/map_faults.py, PROTECTED), and the gate's watch check at the end of the
        # transaction raises, so every result of this read is thrown away (a miss each). Without
        # the compiled handler such a truncate is a SIGBUS (tools/live_drill.py: 3 of 18
        # trials), so each payload is copied out as it is found, narrowing that window to the
        # copy. (On the quiet 2-core VM the two read alike, ~2.1 GB/s raw: docs/BENCHMARKS.md,
        # issue 38; in place spares a block-sized allocation and copy each.)
        in_place = map_faults.PROTECTED
        # Each block handed to a compiled batch as it is read (its metadata checked at once, its
        # header, checks and decode on the batch's threads, the GIL released), so the decodes run
        # while the next blocks are fetched (storage/codec/block_batch.py); a block it leaves
        # undecided (version 3; zstd where libzstd.so.1 is missing) and a sealed store's records
        # take verify_and_decode, zstd's on the decode pool.
        batch = None
        if (self.codec.kind != "zstd" or block_batch.ZSTD) and self._seal is None and block_batch.AVAILABLE:
            batch = block_batch.BlockBatch(self.layout, len(keys), self._decode_threads)
        with self._begin(buffers=True) as txn:
            payload_db, meta_db = self._payload, self._meta
            try:
                for i, (key, p) in enumerate(zip(keys, pending)):
                    if p is not None:
                        # Served from the raw copy awaiting the writer; a key or `out` that does
                        # not match it is a miss (nothing stored is damaged).
                        results[i] = p.copy_for(key, outs[i], self.codec)
                        if payloads is not None and results[i] is not None and p.payload is not None:
                            payloads[i] = bytes(p.payload)
                        hits, misses = hits + (results[i] is not None), misses + (results[i] is None)
                        continue
                    payload, meta = txn.get(key.hash, db=payload_db), txn.get(key.hash, db=meta_db)
                    if payload is None and meta is None:
                        misses += 1
                        gone.append(key.hash)     # evicted by another process, or never stored
                        continue
                    if not in_place:
                        payload = payload if payload is None else bytes(payload)
                        meta = meta if meta is None else bytes(meta)
                    idx.append(i)
                    stored.append(payload)
                    metas.append(meta)
                    if batch is not None:
                        batch.add(key, outs[i], payload, meta)
                # NOTE invariant: the batch's threads read the payloads in the map: they are all
                # joined here, inside the transaction (and abandoned on the way out of a failure).
                decided = batch.finish() if batch is not None else [None] * len(idx)
            except BaseException:
                if batch is not None:
                    batch.abandon()
                raise
            tensors: list[torch.Tensor | None] = [None] * len(idx)
            reasons: list[str | None] = [None] * len(idx)

            def check(j: int) -> None:
                # NOTE invariant: a block is served only once verify_and_decode (or, for a raw or
                # nibble block, block_batch's compiled twin of it, tests/storage/test_raw_batch.py and
                # test_nibble_batch.py) accepted it (its metadata against the key, the header crc32,
                # the binding, the coded crc32 and every frame's checksum, or the raw and nibble
                # codecs' xxh3); anything else leaves
                # tensors[j] None, and it is counted corrupt and deleted below.
                i = idx[j]
                tensors[j], reasons[j] = self._verify_and_decode(keys[i], outs[i], stored[j], metas[j])
            undecided = []
            for j, verdict in enumerate(decided):
                if verdict is None:
                    undecided.append(j)
                else:
                    tensors[j], reasons[j] = verdict
            if len(undecided) > 1 and self._decode_threads > 1 and self.codec.kind != "raw":
                self._on_pool(lambda k: check(undecided[k]), len(undecided))
            else:
                for j in undecided:
                    check(j)
            sizes = [0 if payload is None else len(payload) for payload in stored]
            if payloads is not None:     # copied out of the map (a copy already made is kept); sealed: its payload
                head = 0 if self._seal is None else SEAL_SIZE
                for j, tensor in enumerate(tensors):
                    if tensor is not None:
                        payloads[idx[j]] = stored[j] if isinstance(stored[j], bytes) and not head \
                            else bytes(memoryview(stored[j])[head:])
            stored.clear()
            metas.clear()
        self._index.discard(gone)
        damaged, touched, bytes_read = [], [], 0
        for i, size, tensor, reason in zip(idx, sizes, tensors, reasons):
            key = keys[i]
            if tensor is None:
                log.warning("disk tier: block %s is damaged (%s): a miss", key.hash.hex()[:16], reason)
                damaged.append(key.hash)
            else:
                results[i] = tensor
                touched.append(key.hash)
                bytes_read += size
        with self._stats_lock:
            c = self._counters
            c.store_hits += hits + len(touched)
            c.misses += misses
            c.corrupt += len(damaged)
            c.bytes_read += bytes_read
        if damaged and not self.readonly:
            self._delete_now(damaged)
        if touched and not self.readonly:
            # NOTE: reads never take LMDB's write lock: accesses are recorded by the writer.
            self._writer.record_accesses(touched)
        return results

    def read_ahead(self, keys: Sequence[BlockKey]) -> int:
        """Read these blocks' stored bytes without decoding them, so a later get_many finds them
        in the OS page cache (a prefetch with no host tier to decode into). Returns bytes read;
        never raises (a failed read-ahead only means the later read waits on the drive)."""
        self._check_open()
        total = 0
        try:
            with self._begin(buffers=True) as txn:
                for key in keys:
                    payload = txn.get(key.hash, db=self._payload)
                    if payload is not None:
                        bytes(payload[::4096])   # a byte of every 4 KiB page: each is read in
                        total += len(payload)
        except DiskStalled:
            pass
        except (lmdb.Error, OSError, DamagedEnvironment) as e:
            self._read_failed("read_ahead", e)
        return total

    def iter_blocks(self) -> Iterator[DiskBlockInfo]:
        """Every stored block's metadata, in hash order (undecodable records are skipped:
        verify() reports them). Reads in chunks, so no read transaction stays open long."""
        self._check_open()
        for h, raw in self._iter_db("meta"):
            try:
                m = BlockMeta.unpack(raw)
            except ValueError:
                continue
            yield DiskBlockInfo(h, m.parent, m.namespace, m.token_ids, m.raw_size, m.stored_size, m.reads,
                                m.last_access, m.created)

    def _executor(self) -> ThreadPoolExecutor:
        with self._stats_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._decode_threads, thread_name_prefix="tieredkv-disk-decode",
                                                initializer=background_priority)
            return self._pool

    def _on_pool(self, fn: Callable[[int], None], n: int) -> None:
        """fn(0), ..., fn(n - 1) on the decode threads (storage/pool_drain.py: one task per thread,
        not a future per block). Raises what fn raised."""
        for f in drain_on(self._executor(), self._decode_threads, range(n), fn):
            f.result()

    def _verify_and_decode(self, key: BlockKey, out: torch.Tensor | None, payload: memoryview | None,
                           meta: bytes | None) -> tuple[torch.Tensor | None, str | None]:
        if self._seal is None or payload is None:
            return verify_and_decode(self.codec, self.layout, key, out, payload, meta)
        # A sealed store (storage/disk/seal.py): the seal first, over the record where it lies.
        opened, reason = self._seal.open(key.hash, key.namespace, payload)
        if opened is None:
            return None, reason
        return verify_and_decode(self.codec, self.layout, key, out, opened, meta, head=SEAL_SIZE)

