"""The disk tier's on-disk records: the four LMDB databases, their byte layouts, and the edits
that keep the stored counters equal to what the databases hold.

Databases in the environment directory:

    payload  hash -> codec payload (storage/codec/payload.py)
    meta     hash -> BlockMeta (parent, namespace, token ids, sizes, created, last access seq, reads)
    lru      8-byte big-endian access sequence || hash -> b""   (key order == LRU order)
    retain   hash -> each tenant's retention deadline on the block (storage/disk/retained.py)
    info     b"counters" -> used bytes, blocks, raw bytes, next sequence; b"format" -> version;
             b"capacity" -> the stored-bytes bound every writing process enforces;
             b"sealed" -> the key id of the fleet secret a sealed store's records carry

Knows: how each record is packed and unpacked (a damaged one raises ValueError), the format
version and how to refuse another one, how to open the databases, and the in-transaction edits
every writer shares: delete one block with its counters, recount the counters from `meta`.
Doesn't know: threads, queues, the codec's payload format, eviction policy, or when anything is
written -- that is storage/disk/writer.py and storage/disk/tier.py.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import lmdb

from storage.codec.stored_block import BlockMeta
from storage.disk.preflight import DamagedEnvironment

# 2: payloads are codec v3 or v4, bound to block hash || namespace (version 1's cannot be served).
# Codec v4 did not change it: this build reads the v3 payloads a format-2 store already holds. An
# older build sharing the directory refuses v4 payloads as damaged (a miss, deleted; never KV).
DISK_FORMAT_VERSION = 2
SEQ = struct.Struct(">Q")        # big-endian so LMDB's byte order is numeric order
_U64 = struct.Struct("<Q")
_COUNTERS = struct.Struct("<QQQQ")


def lru_key(seq: int, h: bytes) -> bytes:
    """The `lru` key of block `h` last accessed at sequence `seq`."""
    return SEQ.pack(seq) + h


def lru_hash(key: bytes) -> bytes:
    """The block hash inside an `lru` key."""
    return key[SEQ.size:]




@dataclass(slots=True)
class StoreInfo:
    """The `info` database's counters: what defines capacity, shared by every process."""
    used_bytes: int = 0
    blocks: int = 0
    raw_bytes: int = 0
    next_seq: int = 1


class FormatMismatch(ValueError):
    """The directory holds a disk tier of another format version."""


class StoreDamaged(DamagedEnvironment):
    """Damage found in a store in use by our own checks (a delete that deleted nothing, counters
    that cannot be read): a verdict on the store, handled like LMDB's MDB_CORRUPTED
    (storage/disk/environment.py)."""


class Databases(NamedTuple):
    """The open database handles of one environment (`retain` None: a store opened read-only
    that was written before retention, issue 39)."""
    payload: Any
    meta: Any
    lru: Any
    info: Any
    retain: Any = None


_NAMES = (b"payload", b"meta", b"lru", b"info", b"retain")


def open_databases(env: lmdb.Environment, path: str, readonly: bool) -> Databases:
    """Open (or, writable, create) the databases; raises ValueError for another format version
    and FileNotFoundError when a readonly directory holds no disk tier."""
    if readonly:
        try:
            dbs = Databases(*(env.open_db(n, create=False) for n in _NAMES[:4]))
        except lmdb.NotFoundError:
            raise FileNotFoundError(f"{path} is not a tieredkv disk tier (databases missing)") from None
        with env.begin() as txn:
            _check_format(path, txn.get(b"format", db=dbs.info))
        try:
            dbs = dbs._replace(retain=env.open_db(b"retain", create=False))
        except lmdb.NotFoundError:
            pass               # written before retention: it retains nothing
        return dbs
    if env.info()["last_pgno"] > 1:
        # NOTE: a used environment must already hold our databases. If it holds none, its main
        # database is damaged (or it is not ours): creating them would come up silently empty.
        try:
            env.open_db(b"info", create=False)
        except lmdb.NotFoundError:
            raise DamagedEnvironment(f"{path}: holds data but none of the disk tier's databases "
                                     "(main database damaged, or not a tieredkv disk tier)") from None
    with env.begin(write=True) as txn:
        dbs = Databases(*(env.open_db(n, txn=txn) for n in _NAMES))
        fmt = txn.get(b"format", db=dbs.info)
        if fmt is None:
            txn.put(b"format", _U64.pack(DISK_FORMAT_VERSION), db=dbs.info)
            store_info(txn, dbs, StoreInfo())
        _check_format(path, fmt)
    return dbs


def _check_format(path: str, fmt: bytes | None) -> None:
    if fmt is not None and len(fmt) != _U64.size:
        raise StoreDamaged(f"disk tier {path}: the format record is damaged ({len(fmt)} bytes)")
    if fmt is not None and _U64.unpack(fmt)[0] != DISK_FORMAT_VERSION:
        raise FormatMismatch(f"disk tier {path}: format version {_U64.unpack(fmt)[0]}, this build reads "
                         f"{DISK_FORMAT_VERSION}; point disk_dir elsewhere or delete the directory")


# -- info counters ---------------------------------------------------------------------------

def load_info(txn: lmdb.Transaction, dbs: Databases) -> StoreInfo:
    raw = txn.get(b"counters", db=dbs.info)
    if raw is None:
        return StoreInfo()
    if len(raw) != _COUNTERS.size:
        raise StoreDamaged(f"the info counters are damaged ({len(raw)} bytes, expected {_COUNTERS.size})")
    return StoreInfo(*_COUNTERS.unpack(raw))


def store_info(txn: lmdb.Transaction, dbs: Databases, info: StoreInfo) -> None:
    txn.put(b"counters", _COUNTERS.pack(info.used_bytes, info.blocks, info.raw_bytes, info.next_seq),
            db=dbs.info)


def load_capacity(txn: lmdb.Transaction, dbs: Databases) -> int | None:
    raw = txn.get(b"capacity", db=dbs.info)
    if raw is not None and len(raw) != _U64.size:
        raise StoreDamaged(f"the capacity record is damaged ({len(raw)} bytes)")
    return None if raw is None else _U64.unpack(raw)[0]


def store_capacity(txn: lmdb.Transaction, dbs: Databases, capacity_bytes: int) -> None:
    txn.put(b"capacity", _U64.pack(capacity_bytes), db=dbs.info)


def load_sealed(txn: lmdb.Transaction, dbs: Databases) -> bytes | None:
    """The key id of the fleet secret this store's records are sealed under (storage/disk/
    seal.py), or None for a store that was never opened sealed."""
    raw = txn.get(b"sealed", db=dbs.info)
    return None if raw is None else bytes(raw)


def store_sealed(txn: lmdb.Transaction, dbs: Databases, key_id: bytes) -> None:
    txn.put(b"sealed", key_id, db=dbs.info)


# -- edits inside a write transaction: `info` changes with the blocks it counts ---------------

def read_meta(txn: lmdb.Transaction, dbs: Databases, h: bytes) -> tuple[bytes | None, BlockMeta | None]:
    """Block `h`'s meta record as stored and decoded: (None, None) when there is none, (raw, None)
    when it is there but cannot be decoded (damaged)."""
    raw = txn.get(h, db=dbs.meta)
    try:
        return raw, None if raw is None else BlockMeta.unpack(raw)
    except ValueError:
        return raw, None


@dataclass(slots=True)
class MetaScan:
    """One pass over every `meta` record: the counters they add up to, and what else a repair needs."""
    info: StoreInfo
    hashes: list[bytes]            # blocks with a decodable record
    undecodable: list[bytes]       # records that cannot be decoded
    lru_keys: list[bytes]          # the LRU entry each decodable block should have, in key order


def scan_meta(txn: lmdb.Transaction, dbs: Databases, next_seq: int = 1) -> MetaScan:
    scan = MetaScan(StoreInfo(next_seq=next_seq), [], [], [])
    info = scan.info
    for h, v in txn.cursor(db=dbs.meta):
        h = bytes(h)
        try:
            m = BlockMeta.unpack(v)
        except ValueError:
            scan.undecodable.append(h)
            continue
        scan.hashes.append(h)
        scan.lru_keys.append(lru_key(m.last_access, h))
        info.used_bytes += m.stored_size
        info.raw_bytes += m.raw_size
        info.blocks += 1
        info.next_seq = max(info.next_seq, m.last_access + 1)
    scan.lru_keys.sort()
    return scan


def delete_in_txn(txn: lmdb.Transaction, dbs: Databases, h: bytes, info: StoreInfo) -> bool:
    """Delete block `h` (payload, meta, LRU entry) and take it off `info`. True when it existed.

    NOTE: every delete proves it deleted: a record that was read in this transaction but that
    LMDB's delete does not find means the tree is out of order (a flipped bit in a leaf):
    StoreDamaged, never a True that lets a caller's loop meet the same entry again."""
    raw, m = read_meta(txn, dbs, h)
    if m is None:
        # No usable metadata: sizes and LRU position are unknown, so scan and recount (rare).
        found = txn.delete(h, db=dbs.payload) | txn.delete(h, db=dbs.meta)
        if raw is not None and txn.get(h, db=dbs.meta) is not None:
            raise StoreDamaged(f"meta record {h.hex()[:16]} survives its delete")
        cur = txn.cursor(db=dbs.lru)
        stale = [bytes(k) for k in cur.iternext(keys=True, values=False) if lru_hash(k) == h]
        for k in stale:
            if not txn.delete(k, db=dbs.lru):
                raise StoreDamaged(f"LRU entry of {h.hex()[:16]} cannot be deleted (the lru tree is damaged)")
        recount(txn, dbs, info)
        return found or bool(stale)
    txn.delete(lru_key(m.last_access, h), db=dbs.lru)   # may be missing (verify reports it)
    if not txn.delete(h, db=dbs.meta):
        raise StoreDamaged(f"meta record {h.hex()[:16]} was read but cannot be deleted (the meta tree is damaged)")
    txn.delete(h, db=dbs.payload)
    info.used_bytes = max(0, info.used_bytes - m.stored_size)
    info.raw_bytes = max(0, info.raw_bytes - m.raw_size)
    info.blocks = max(0, info.blocks - 1)
    return True


def recount(txn: lmdb.Transaction, dbs: Databases, info: StoreInfo) -> None:
    """Recompute `info`'s counters from every decodable `meta` record."""
    counted = scan_meta(txn, dbs, info.next_seq).info
    info.used_bytes, info.raw_bytes, info.blocks = counted.used_bytes, counted.raw_bytes, counted.blocks
    info.next_seq = counted.next_seq


def repair_counters(txn: lmdb.Transaction, dbs: Databases) -> tuple[list[bytes], list[str]]:
    """Make `info` and the LRU index agree with the `meta` records, in one write transaction:
    undecodable meta records and payloads without meta are deleted, the counters recounted, and
    the LRU index rebuilt when it is not exactly one entry per block at its access sequence.
    Returns (every stored hash, what was wrong). Run at open (storage/disk/environment.py) and
    by verify --repair: counters that are wrong hold a store over its capacity, an LRU entry
    missing keeps a block from ever being evicted."""
    fixed: list[str] = []
    try:
        old: StoreInfo | None = load_info(txn, dbs)
    except StoreDamaged:
        old = None
        fixed.append("info counters unreadable")
    scan = scan_meta(txn, dbs, old.next_seq if old else 1)
    info, hashes, undecodable, want_lru = scan.info, scan.hashes, scan.undecodable, scan.lru_keys
    for h in undecodable:
        txn.delete(h, db=dbs.meta)
        txn.delete(h, db=dbs.payload)
    if undecodable:
        fixed.append(f"{len(undecodable)} undecodable meta record(s) deleted")
    if txn.stat(dbs.payload)["entries"] != len(hashes):
        known = set(hashes)
        orphans = [bytes(k) for k in txn.cursor(db=dbs.payload).iternext(keys=True, values=False)
                   if bytes(k) not in known]
        for k in orphans:
            txn.delete(k, db=dbs.payload)
        if orphans:
            fixed.append(f"{len(orphans)} payload(s) without metadata deleted")
    have_lru = [bytes(k) for k in txn.cursor(db=dbs.lru).iternext(keys=True, values=False)]
    if have_lru != want_lru:
        txn.drop(dbs.lru, delete=False)
        for k in want_lru:
            txn.put(k, b"", db=dbs.lru, append=True)
        fixed.append(f"LRU index rebuilt ({len(have_lru)} entries for {len(want_lru)} blocks)")
    if old is not None and (old.used_bytes, old.raw_bytes, old.blocks) != (info.used_bytes, info.raw_bytes, info.blocks):
        fixed.append(f"info counters said {old.blocks} blocks / {old.used_bytes} bytes, the store holds "
                      f"{info.blocks} / {info.used_bytes}")
    if old is None or old != info:
        store_info(txn, dbs, info)
    return hashes, fixed
