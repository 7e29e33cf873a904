"""Label every page of an LMDB data.mdb by what it is, with plain file reads (no LMDB, no map).

    python tools/lmdb_pages.py STORE_DIR          # counts per kind
    python tools/fault_drill.py --self-check      # populate the drill's store, compare with py-lmdb's stats

Used by tools/fault_drill.py to aim a bit flip at one kind of page on purpose.

LMDB 0.9 layout (64-bit, little-endian), offsets from the start of a page:
    page header   pgno u64 @0, pad u16 @8, flags u16 @10 (P_BRANCH 0x01, P_LEAF 0x02,
                  P_OVERFLOW 0x04, P_META 0x08, P_LEAF2 0x20), then lower u16 @12, upper u16 @14,
                  or, on an overflow page, the run's page count u32 @12
    node offsets  u16 array @16, (lower - 16) / 2 of them
    node          lo u16 @0, hi u16 @2, flags u16 @4 (F_BIGDATA 1, F_SUBDATA 2, F_DUPDATA 4),
                  ksize u16 @6, key @8, data after it; branch: child = lo | hi << 16 | flags << 32;
                  leaf: data size = lo | hi << 16; F_BIGDATA: data is the first overflow page (u64)
    MDB_db        pad u32, flags u16, depth u16, branch/leaf/overflow pages u64, entries u64,
                  root u64 (48 bytes)
    meta page     MDB_meta @16: magic, version, address, mapsize, dbs[0] (free pages) @40,
                  dbs[1] (main) @88, last_pg u64 @136, txnid u64 @144
The free-page database's values are ID lists (count u64, then that many page numbers): those
pages are free (their bytes are stale copies), labelled `free`.

Kinds: metapage_cur (the newer meta page, the one LMDB uses), metapage_prev, free (free-listed),
freedb_branch/leaf/ovf_head/ovf_cont, main_branch/leaf, and <db>_branch/leaf/ovf_head/ovf_cont
for each named database (payload, meta, lru, info).
Pages no tree reaches and no free list names are `orphan` (there should be none after a commit).
"""
from __future__ import annotations

import os
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = 0xFFFFFFFFFFFFFFFF
HDR, NODE = 16, 8
DB = struct.Struct("<IHHQQQQQ")   # MDB_db: pad, flags, depth, branch, leaf, overflow, entries, root


@dataclass
class DbRecord:
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def unpack(cls, raw: bytes, at: int = 0) -> "DbRecord":
        _, *rest = DB.unpack_from(raw, at)
        return cls(*rest)


@dataclass
class PageMap:
    page_size: int
    last_page: int
    txnid: int
    meta_index: int                      # which meta page (0 or 1) is the newer
    kinds: dict[int, str] = field(default_factory=dict)    # pgno -> kind
    records: dict[str, DbRecord] = field(default_factory=dict)   # "freedb", "main", named dbs
    counted: dict[str, Counter] = field(default_factory=dict)    # db -> branch/leaf/overflow seen
    problems: list[str] = field(default_factory=list)

    def by_kind(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for pgno, kind in sorted(self.kinds.items()):
            out.setdefault(kind, []).append(pgno)
        return out


def _meta(data: bytes, at: int) -> tuple[int, int, DbRecord, DbRecord, int, int] | None:
    if len(data) < at + 152:
        return None
    flags, = struct.unpack_from("<H", data, at + 10)
    magic, = struct.unpack_from("<I", data, at + 16)
    if not flags & P_META or magic != 0xBEEFC0DE:
        return None
    psize, = struct.unpack_from("<I", data, at + 40)        # dbs[0].md_pad holds the page size
    last, txnid = struct.unpack_from("<QQ", data, at + 136)
    return psize, at, DbRecord.unpack(data, at + 40), DbRecord.unpack(data, at + 88), last, txnid


def classify(path: str) -> PageMap:
    """Label every page 0..last_pg of `path` (a store directory or its data.mdb)."""
    data_path = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
    with open(data_path, "rb") as f:
        data = f.read()
    m0 = _meta(data, 0)
    m1 = _meta(data, m0[0]) if m0 else None
    metas = [(i, m) for i, m in enumerate((m0, m1)) if m is not None]
    if not metas:
        raise ValueError(f"{data_path}: no readable meta page")
    index, (psize, _, free_db, main_db, last, txnid) = max(metas, key=lambda im: im[1][5])
    pm = PageMap(psize, last, txnid, index)
    pm.kinds[index], pm.kinds[1 - index] = "metapage_cur", "metapage_prev"   # the newer: LMDB opens it
    pm.records["freedb"], pm.records["main"] = free_db, main_db
    free_listed: set[int] = set()

    def page(pgno: int) -> bytes | None:
        if not 2 <= pgno <= last or (pgno + 1) * psize > len(data):
            pm.problems.append(f"page {pgno} outside 2..{last}")
            return None
        return data[pgno * psize:(pgno + 1) * psize]

    def label(pgno: int, kind: str) -> bool:
        if pgno in pm.kinds:
            pm.problems.append(f"page {pgno} reached twice ({pm.kinds[pgno]}, {kind})")
            return False
        pm.kinds[pgno] = kind
        return True

    def walk(root: int, db: str) -> None:
        counted = pm.counted.setdefault(db, Counter())
        if root == P_INVALID:
            return
        stack = [root]
        while stack:
            pgno = stack.pop()
            p = page(pgno)
            if p is None:
                continue
            flags, lower, upper = struct.unpack_from("<HHH", p, 10)
            kind = "branch" if flags & P_BRANCH else "leaf" if flags & (P_LEAF | P_LEAF2) else None
            if kind is None or not label(pgno, f"{db}_{kind}"):
                if kind is None:
                    pm.problems.append(f"{db}: page {pgno} has flags {flags:#x}")
                continue
            counted[kind] += 1
            n = max(0, (lower - HDR) // 2)
            for off in struct.unpack_from(f"<{n}H", p, HDR):
                if off + NODE > psize:
                    pm.problems.append(f"{db}: page {pgno} node at {off}")
                    continue
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, off)
                if kind == "branch":
                    stack.append(lo | hi << 16 | nflags << 32)
                    continue
                size, at = lo | hi << 16, off + NODE + ksize
                if nflags & F_BIGDATA:
                    first, = struct.unpack_from("<Q", p, at)
                    head = page(first)
                    if head is None:
                        continue
                    hflags, = struct.unpack_from("<H", head, 10)
                    count, = struct.unpack_from("<I", head, 12)
                    if not hflags & P_OVERFLOW:
                        pm.problems.append(f"{db}: overflow page {first} has flags {hflags:#x}")
                    label(first, f"{db}_ovf_head")
                    for q in range(first + 1, first + count):
                        label(q, f"{db}_ovf_cont")
                    counted["overflow"] += count
                    value = data[first * psize + HDR:first * psize + HDR + size]
                else:
                    value = p[at:at + size]
                if db == "freedb" and len(value) >= 8:
                    n_ids, = struct.unpack_from("<Q", value, 0)
                    free_listed.update(struct.unpack_from(f"<{n_ids}Q", value, 8)
                                       if 8 * (n_ids + 1) <= len(value) else ())
                if db == "main" and nflags & F_SUBDATA and size == DB.size:
                    name = p[off + NODE:off + NODE + ksize].decode("ascii", "replace")
                    rec = DbRecord.unpack(value)
                    pm.records[name] = rec
                    walk(rec.root, name)

    walk(free_db.root, "freedb")
    walk(main_db.root, "main")
    for pgno in sorted(free_listed):
        if pgno in pm.kinds:
            pm.problems.append(f"free-listed page {pgno} is also {pm.kinds[pgno]}")
        elif 2 <= pgno <= last:
            pm.kinds[pgno] = "free"
    for pgno in range(2, last + 1):
        pm.kinds.setdefault(pgno, "orphan")
    return pm


def compare_with_lmdb(path: str, pm: PageMap) -> list[str]:
    """Differences between the walk's page counts and py-lmdb's env.stat()/txn.stat(db) and the
    meta page's free-page database record (py-lmdb cannot open FREE_DBI). Empty when they agree."""
    import lmdb
    diffs: list[str] = []
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=8)
    try:
        stats = {"main": env.stat()}
        with env.begin() as txn:
            if txn.id() != pm.txnid:
                diffs.append(f"txnid: walk {pm.txnid}, lmdb {txn.id()}")
            for name in pm.records:
                if name not in ("freedb", "main"):
                    stats[name] = txn.stat(env.open_db(name.encode(), txn=txn, create=False))
        last = env.info()["last_pgno"]
    finally:
        env.close()
    if last != pm.last_page:
        diffs.append(f"last_pgno: walk {pm.last_page}, lmdb {last}")
    f = pm.records["freedb"]
    stats["freedb"] = {"branch_pages": f.branch_pages, "leaf_pages": f.leaf_pages,
                       "overflow_pages": f.overflow_pages}
    for db, st in stats.items():
        seen = pm.counted.get(db, Counter())
        for k in ("branch", "leaf", "overflow"):
            if seen[k] != st[f"{k}_pages"]:
                diffs.append(f"{db} {k} pages: walk {seen[k]}, lmdb {st[f'{k}_pages']}")
    kinds = Counter(pm.kinds.values())
    if kinds["orphan"]:
        diffs.append(f"{kinds['orphan']} pages neither in a tree nor free-listed")
    return diffs + pm.problems


def print_counts(pm: PageMap) -> None:
    print(f"page size {pm.page_size}, pages 0..{pm.last_page}, txnid {pm.txnid} (meta page {pm.meta_index})")
    for kind, pages in sorted(pm.by_kind().items()):
        print(f"  {kind:<16} {len(pages):>6}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    pm = classify(sys.argv[1])
    print_counts(pm)
    diffs = compare_with_lmdb(sys.argv[1], pm)
    print("agrees with LMDB's page counts" if not diffs else "\n".join(["MISMATCH:"] + diffs))
