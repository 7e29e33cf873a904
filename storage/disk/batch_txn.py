"""One batch's write transaction in the disk store: what the disk writer commits, record by record.

Knows: the order inside the transaction -- the batch's recorded accesses first (they happened
before its puts: LRU position and read count), its retention deadlines (merged with the stored
ones), then its puts (skipped when another process stored the block first; sealed when the
directory is sealed), then the capacity bound enforced by evicting in LRU order -- and what the
writer needs back once it commits (which keys are stored, which evicted, the payloads for the
remote tier's write-behind).
Doesn't know: the queue, which puts are still live (the writer decides, under its lock, before
calling), the environment's lifecycle or retries (storage/disk/writer.py), the record layouts
(storage/disk/records.py) or how room is chosen (storage/disk/room.py).

Threads: the writer thread, inside its write transaction; nothing here waits or takes a lock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from storage.codec.stored_block import BlockMeta
from storage.disk.records import StoreInfo, lru_key, read_meta, store_info
from storage.disk.retained import merge_in_txn
from storage.disk.room import evict_in_txn
from storage.hashing import BlockKey
from storage.retention import RetainRow

if TYPE_CHECKING:
    import lmdb

    from storage.disk.pending import PendingBlock
    from storage.disk.records import Databases


@dataclass(slots=True)
class BatchWritten:
    """What one batch's transaction did, for the writer to act on once it commits."""
    info: StoreInfo                     # the store's counters as committed
    written: int = 0                    # record bytes this transaction added
    stored: list[BlockKey] = field(default_factory=list)    # every put now in the store (new or there first)
    new: list[tuple[BlockKey, bytes, int]] = field(default_factory=list)   # (key, payload, raw size) stored here
    evicted: list[bytes] = field(default_factory=list)      # hashes evicted by the capacity bound


def write_batch(txn: lmdb.Transaction, dbs: Databases, info: StoreInfo, capacity: int, now: float,
                live: Iterable[tuple[PendingBlock, bytes | memoryview]], touches: dict[bytes, int],
                retains: list[RetainRow], seal=None, keep_payloads: bool = False) -> BatchWritten:
    """Write a batch inside `txn` (see the module docstring); `info` is the store's counters read
    in the same transaction and is updated and stored. `keep_payloads`: return each new block's
    payload as bytes (a view of the encode process's memory is copied: it outlives the batch)."""
    out = BatchWritten(info)
    for h, n in touches.items():   # accesses first: they happened before this batch's puts
        _, m = read_meta(txn, dbs, h)
        if m is None:
            continue   # evicted or deleted since it was read (or damaged: the next get deletes it)
        txn.delete(lru_key(m.last_access, h), db=dbs.lru)
        m.last_access, m.reads = info.next_seq, m.reads + n
        info.next_seq += 1
        txn.put(h, m.pack(), db=dbs.meta)
        txn.put(lru_key(m.last_access, h), b"", db=dbs.lru)
    if retains and dbs.retain is not None:
        merge_in_txn(txn, dbs.retain, list(retains), now)
    for it, payload in live:
        key, raw_size = it.key, it.nbytes
        h = key.hash
        if txn.get(h, db=dbs.meta) is not None:
            out.stored.append(key)   # another process stored it first
            continue
        record = payload if seal is None else seal.record(h, key.namespace, payload)
        m = BlockMeta(key.parent, key.namespace, key.token_ids, raw_size, len(record), now, info.next_seq, 0)
        info.next_seq += 1
        txn.put(h, record, db=dbs.payload)
        txn.put(h, m.pack(), db=dbs.meta)
        txn.put(lru_key(m.last_access, h), b"", db=dbs.lru)
        info.used_bytes += len(record)
        info.raw_bytes += raw_size
        info.blocks += 1
        out.written += len(record)
        out.stored.append(key)
        if keep_payloads:
            out.new.append((key, payload if isinstance(payload, bytes) else bytes(payload), raw_size))
    # NOTE: the capacity invariant (used_bytes <= capacity) is enforced here, in the same
    # transaction that added the bytes: no committed state exceeds it, whichever process committed it.
    evict_in_txn(txn, dbs, info, lambda: info.used_bytes > capacity, out.evicted, now)
    store_info(txn, dbs, info)
    return out
