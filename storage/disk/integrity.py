"""What a sound disk tier looks like: the checks a stored block passes before it is served, the
deeper checks of verify(), and check()'s audit of the counters and indexes.

Knows: how a stored block must agree with the key asking for it (token ids, namespace, parent in
`meta`; the payload's binding -- block hash and namespace, inside the codec's checked header),
with its metadata (sizes), with the codec (header, checksum, full decode) and the layout; that a
stored block's hash must equal hash_block(parent, token_ids); and that the `info` counters and
the `lru` index must match the `meta` records exactly.
Doesn't know: what to do about damage (the tier counts, deletes, repairs), threads, or writing.
"""
from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, ContextManager, Iterator

import lmdb

from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta, check_stored
from storage.codec.verify_report import DamagedBlock, VerifyReport
from storage.disk.records import Databases, StoreDamaged, load_info, lru_key
from storage.disk.seal import SEAL_SIZE, DiskSeal

_CHUNK = 512                     # keys per read transaction
from storage.layout import BlockLayout
from storage.hashing import BlockKey, hash_block


def check_block(codec: Codec, layout: BlockLayout | None, h: bytes, payload: bytes | None,
                meta: bytes | None, seal: DiskSeal | None = None) -> str | None:
    """verify()'s check of one stored block (a sealed store's: its seal first): None when sound,
    else the reason."""
    if payload is None or meta is None:
        return "payload missing" if payload is None else "metadata missing"
    try:
        m = BlockMeta.unpack(meta)
    except ValueError as e:
        return str(e)
    if hash_block(m.parent, m.token_ids) != h:
        return "hash chain broken: hash != hash_block(parent, token_ids)"
    key = BlockKey(h, m.parent, m.token_ids, m.namespace)
    if seal is not None:
        opened, reason = seal.open(h, m.namespace, payload)
        if opened is None:
            return reason
        return check_stored(codec, layout, key, opened, meta, head=SEAL_SIZE)
    return check_stored(codec, layout, key, payload, meta)


def verify_store(begin: Callable[..., ContextManager[lmdb.Transaction]], iter_db: Callable[..., Iterator[tuple]],
                 databases: Callable[[], Databases], executor: Executor, codec: Codec,
                 layout: BlockLayout | None, seal: DiskSeal | None = None) -> VerifyReport:
    """verify()'s walk: every block of the store checked (check_block, plus its LRU entry), a
    chunk of keys per read transaction, the decodes on `executor`. Deletes nothing.
    `databases()` gives the handles, asked inside each transaction (storage/disk/environment.py)."""
    hashes = sorted({h for h, _ in iter_db("payload", values=False)}
                    | {h for h, _ in iter_db("meta", values=False)})
    damaged: list[DamagedBlock] = []
    checked = 0
    for start in range(0, len(hashes), _CHUNK):
        chunk = hashes[start:start + _CHUNK]
        with begin() as txn:
            dbs = databases()
            rows = [(h, txn.get(h, db=dbs.payload), txn.get(h, db=dbs.meta)) for h in chunk]
            # A block whose payload and meta are both gone was evicted or deleted after the
            # listing (a live cache keeps evicting): not damage. A delete removes both in one
            # transaction, and this chunk reads one snapshot, so one without the other is.
            rows = [r for r in rows if r[1] is not None or r[2] is not None]
            checked += len(rows)
            lru_ok = {}
            for h, _, meta in rows:
                try:
                    lru_ok[h] = txn.get(lru_key(BlockMeta.unpack(meta).last_access, h), db=dbs.lru) is not None
                except (ValueError, TypeError):
                    lru_ok[h] = True   # reported by check_block
        reasons = executor.map(lambda r: check_block(codec, layout, *r, seal), rows)
        for (h, payload, meta), reason in zip(rows, reasons):
            if reason is None and not lru_ok[h]:
                reason = "LRU entry missing"
            if reason is not None:
                damaged.append(DamagedBlock(h, reason))
    return VerifyReport(checked=checked, damaged=tuple(damaged), repaired=0)



def audit(begin: Callable[..., ContextManager[lmdb.Transaction]], databases: Callable[[], Databases],
          capacity_bytes: int) -> list[str]:
    """Recompute every counter and index from the databases and compare.
    Returns the problems found (empty when consistent)."""
    problems: list[str] = []
    with begin() as txn:
        dbs = databases()
        try:
            info = load_info(txn, dbs)
        except StoreDamaged as e:
            return [str(e)]
        used = raw = blocks = 0
        max_seq = 0
        for h, v in txn.cursor(db=dbs.meta):
            try:
                m = BlockMeta.unpack(v)
            except ValueError as e:
                problems.append(f"{h.hex()[:16]}: {e}")
                continue
            blocks += 1
            used += m.stored_size
            raw += m.raw_size
            max_seq = max(max_seq, m.last_access)
            p = txn.get(h, db=dbs.payload)
            if p is None or len(p) != m.stored_size:
                problems.append(f"{h.hex()[:16]}: payload missing or size != {m.stored_size}")
            if txn.get(lru_key(m.last_access, h), db=dbs.lru) is None:
                problems.append(f"{h.hex()[:16]}: LRU entry missing")
        n_payload = txn.stat(dbs.payload)["entries"]
        n_lru = txn.stat(dbs.lru)["entries"]
    for name, want, got in (("used_bytes", used, info.used_bytes), ("raw_bytes", raw, info.raw_bytes),
                            ("blocks", blocks, info.blocks), ("payload entries", blocks, n_payload),
                            ("lru entries", blocks, n_lru)):
        if want != got:
            problems.append(f"{name}: counted {want}, recorded {got}")
    if info.next_seq <= max_seq:
        problems.append(f"next_seq {info.next_seq} <= a used sequence {max_seq}")
    if info.used_bytes > capacity_bytes:
        problems.append(f"used_bytes {info.used_bytes} > capacity {capacity_bytes}")
    return problems
