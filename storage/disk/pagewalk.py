"""Every page pointer of an LMDB environment checked before LMDB follows any of them.

Knows: LMDB 0.9's page and node layout (below) and the shape of its trees -- branch pages point
at child pages; the main database's leaf nodes hold the named databases' records (`MDB_db`, with
their root page); a leaf node flagged F_BIGDATA points at a run of overflow pages holding its
value. `check_pages` walks the trees of one snapshot (the free-page database, the main database,
every named database) reading pages with pread, never through the map, and checks that every
pointer lands inside the file's used pages, on a page of the kind expected that carries its own
page number, that every node lies inside its page, that every overflow run starts with an
overflow header of its own number and length, and that the free-page database's lists name
only pages no tree of the snapshot uses (and none twice): LMDB hands a listed page to its next
writer, which would overwrite a live page with it ("Located page was wrong type" on every
later commit, or another record's bytes changed).
Why: LMDB trusts its pointers. One flipped bit in a leaf page moved a node pointer 32 KiB past
the end of the file, and the first cursor walk over it (building the disk index at open) died of
SIGBUS -- every restart again (tools/fault_drill.py, docs/BENCHMARKS.md "Reliability"). The meta
page checks of storage/disk/preflight.py run before mapping; this runs after mapping (a read
transaction pins the snapshot it walks, so no writer reuses its pages meanwhile) and before any
read goes through the map.
Doesn't know: our keys, values or records (storage/disk/records.py), nor what a payload's bytes
mean: a pointer to the wrong page inside the file is the codec's to catch (a block's binding and
checksums), so overflow runs are bounds-checked, not read.

LMDB 0.9 layout, little-endian, offsets from the start of a page (PAGEBASE is 0 in releases):
    page header   mp_pgno u64 @0, mp_flags u16 @10, mp_lower u16 @12, mp_upper u16 @14 (16 bytes)
    node offsets  u16 array @16, (mp_lower - 16) / 2 of them, each from the page's start
    node          mn_lo u16 @0, mn_hi u16 @2, mn_flags u16 @4, mn_ksize u16 @6, key @8, then data
                  branch: child page = lo | hi << 16 | flags << 32; leaf: data size = lo | hi << 16
    MDB_db        md_flags u16 @4, md_depth u16 @6, ..., md_entries u64 @32, md_root u64 @40 (48 bytes)
    overflow      the first page of a run: mp_flags has P_OVERFLOW (0x04), mp_pages u32 @12 = its length
    free-page db  key: a txn id (u64); value: a page list, a u64 count then that many u64 page numbers
    meta page     mm_dbs[0] (free pages) @40 (root @80), mm_dbs[1] (main) @88 (root @128),
                  mm_last_pg u64 @136, mm_txnid u64 @144
"""
from __future__ import annotations

import bisect
import logging
import os
import struct

import lmdb

from storage.disk.preflight import DamagedEnvironment, MetaPage, read_meta_pages

log = logging.getLogger(__name__)

_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_P_INVALID = 0xFFFFFFFFFFFFFFFF
_HDR, _NODE, _DB = 16, 8, 48
_ATTEMPTS = 5


def check_pages(env: lmdb.Environment, path: str, begin=None) -> int:
    """Walk the environment's current snapshot; raises DamagedEnvironment naming the first bad
    pointer. Returns the pages read (0 when there is no data yet). `begin`: how to start the read
    transaction that pins the snapshot (a tier's gate; default env.begin)."""
    begin = begin or env.begin
    data = os.path.join(path, "data.mdb")
    if not os.path.isfile(data) or os.path.getsize(data) == 0:
        return 0
    with open(data, "rb") as f:
        fd = f.fileno()
        for _ in range(_ATTEMPTS):
            # NOTE: the read transaction registers us as a reader of its snapshot, so no writer
            # (this process's or another's) reuses that snapshot's pages while we walk them.
            with begin() as txn:
                meta = next((m for m in read_meta_pages(f) if m is not None and m.txnid == txn.id()), None)
                if meta is None:
                    continue        # both meta pages are newer than our snapshot: take a new one
                return _Walk(fd, meta, data).run()
    log.warning("disk tier %s: its snapshot kept moving (busy writers); page pointers not checked", path)
    return 0


class _Walk:
    def __init__(self, fd: int, meta: MetaPage, data: str) -> None:
        self.fd, self.meta, self.data = fd, meta, data
        self.psize = meta.page_size
        self.seen: set[int] = set()
        self.runs: list[tuple[int, int]] = []     # every overflow run (first, last) of the snapshot
        self.free: list[int] = []                 # every page the free-page database lists

    def fail(self, what: str) -> None:
        raise DamagedEnvironment(f"{self.data}: {what}")

    def run(self) -> int:
        for name, root, depth in (("free-page database", self.meta.free_root, self.meta.free_depth),
                                  ("main database", self.meta.main_root, self.meta.main_depth)):
            if root != _P_INVALID:
                self.tree(root, name, depth, main=name == "main database")
        self.check_free()
        return len(self.seen)

    def overflow(self, pgno: int, first: int, last: int, size: int, name: str) -> None:
        """The header of a run of overflow pages: its own number, the overflow flag, its length."""
        head = os.pread(self.fd, _HDR, first * self.psize)
        own, = struct.unpack_from("<Q", head, 0)
        flags, pages = struct.unpack_from("<HI", head, 10)
        if own != first or not flags & _P_OVERFLOW or pages != last - first + 1:
            self.fail(f"{name}: page {pgno} points a {size}-byte value at page {first}, whose overflow header "
                      f"is damaged (says page {own}, flags {flags:#x}, {pages} pages; expected {last - first + 1})")
        self.runs.append((first, last))

    def free_list(self, p: bytes, off: int, end: int, size: int, nflags: int, pgno: int) -> None:
        """One free-page database record: its list of page numbers, read and kept for check_free.
        Its key is the id of the transaction that freed them, never past the snapshot's own
        (LMDB asserts `id <= me_pglast` in mdb_freelist_save: a larger one aborted the process)."""
        ksize, = struct.unpack_from("<H", p, off + 6)
        if ksize != 8 or struct.unpack_from("<Q", p, off + _NODE)[0] > self.meta.txnid:
            self.fail(f"free-page database: page {pgno} holds a damaged key (a transaction id past "
                      f"the snapshot's {self.meta.txnid})")
        if nflags & _F_BIGDATA:
            first, = struct.unpack_from("<Q", p, end)
            raw = os.pread(self.fd, size, first * self.psize + _HDR)
        else:
            raw = p[end:end + size]
        if len(raw) < 8 or len(raw) != 8 * (struct.unpack_from("<Q", raw, 0)[0] + 1):
            self.fail(f"free-page database: page {pgno} holds a damaged page list ({size} bytes)")
        count, = struct.unpack_from("<Q", raw, 0)
        self.free.extend(struct.unpack_from(f"<{count}Q", raw, 8))

    def check_free(self) -> None:
        """Every listed free page inside the file, listed once, and used by no tree or overflow run
        of the snapshot; and no two overflow runs sharing a page."""
        runs = sorted(self.runs)
        for (a0, a1), (b0, _) in zip(runs, runs[1:]):
            if b0 <= a1:
                self.fail(f"overflow runs {a0}..{a1} and {b0}.. share pages")
        starts = [r[0] for r in runs]

        def in_run(pg: int) -> bool:
            i = bisect.bisect_right(starts, pg) - 1
            return i >= 0 and runs[i][0] <= pg <= runs[i][1]
        for pg in self.seen:
            if in_run(pg):
                self.fail(f"tree page {pg} lies inside an overflow run")
        listed: set[int] = set()
        for pg in self.free:
            if not 2 <= pg <= self.meta.last_page:
                self.fail(f"free-page database lists page {pg}, outside the file's pages 2..{self.meta.last_page}")
            if pg in listed:
                self.fail(f"free-page database lists page {pg} twice")
            if pg in self.seen or in_run(pg):
                self.fail(f"free-page database lists page {pg}, which the snapshot still uses")
            listed.add(pg)

    def page(self, pgno: int, what: str) -> bytes:
        if not 2 <= pgno <= self.meta.last_page:
            self.fail(f"{what}: page {pgno} is outside the file's pages 2..{self.meta.last_page}")
        if pgno in self.seen:
            self.fail(f"{what}: page {pgno} is reached twice (a loop or a shared page)")
        self.seen.add(pgno)
        p = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(p) < self.psize:
            self.fail(f"{what}: page {pgno} is cut short")
        return p

    def tree(self, root: int, name: str, depth: int, main: bool = False) -> None:
        """Walk one B+tree of `depth` levels: every page at the last level a leaf, every other a
        branch (LMDB asserts as much in mdb_cursor_sibling: a child of the wrong kind aborted the
        process), every branch with at least one child."""
        free = name == "free-page database"
        if not 1 <= depth <= 32:
            self.fail(f"{name}: a depth of {depth} levels")
        stack = [(root, 1)]
        while stack:
            pgno, level = stack.pop()
            p = self.page(pgno, name)
            own, = struct.unpack_from("<Q", p, 0)
            flags, lower, upper = struct.unpack_from("<HHH", p, 10)
            kind = flags & (_P_BRANCH | _P_LEAF)
            if own != pgno or kind not in (_P_BRANCH, _P_LEAF):
                self.fail(f"{name}: page {pgno} is not a branch or leaf page of its own number "
                          f"(says page {own}, flags {flags:#x})")
            # NOTE: exactly one kind bit and nothing else: a stored page never carries P_DIRTY (with it
            # set LMDB would edit the read-only map in place instead of copying: SIGSEGV).
            if flags != (_P_LEAF if level == depth else _P_BRANCH):
                self.fail(f"{name}: page {pgno} at level {level} of {depth} has flags {flags:#x}")
            if kind == _P_BRANCH and lower < _HDR + 2:
                self.fail(f"{name}: branch page {pgno} has no child")
            if not (_HDR <= lower <= upper <= self.psize) or (lower - _HDR) % 2:
                self.fail(f"{name}: page {pgno} has a damaged header (lower {lower}, upper {upper})")
            n = (lower - _HDR) // 2
            packed = 0              # the nodes' sizes as LMDB lays them out: EVEN(8 + key + data) each
            for off in struct.unpack_from(f"<{n}H", p, _HDR):
                if off < upper or off + _NODE > self.psize:
                    self.fail(f"{name}: page {pgno} has a node at {off}, outside {upper}..{self.psize}")
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, off)
                end = off + _NODE + ksize
                if kind == _P_BRANCH:
                    if end > self.psize:
                        self.fail(f"{name}: page {pgno} has a key running past the page")
                    packed += (_NODE + ksize + 1) & ~1
                    stack.append((lo | hi << 16 | nflags << 32, level + 1))
                    continue
                size = lo | hi << 16
                packed += (_NODE + ksize + (8 if nflags & _F_BIGDATA else size) + 1) & ~1
                if nflags & _F_DUPDATA:
                    self.fail(f"{name}: page {pgno} has a duplicate-sorted node (none of ours is)")
                if nflags & _F_BIGDATA:
                    if end + 8 > self.psize:
                        self.fail(f"{name}: page {pgno} has a node running past the page")
                    first, = struct.unpack_from("<Q", p, end)
                    last = first + (_HDR - 1 + size) // self.psize      # LMDB's OVPAGES - 1
                    if not 2 <= first or last > self.meta.last_page:
                        self.fail(f"{name}: page {pgno} points a {size}-byte value at pages {first}..{last}, "
                                  f"outside the file's pages 2..{self.meta.last_page}")
                    self.overflow(pgno, first, last, size, name)
                    if free:
                        self.free_list(p, off, end, size, nflags, pgno)
                    continue
                if end + size > self.psize:
                    self.fail(f"{name}: page {pgno} has a node running past the page")
                if free:
                    self.free_list(p, off, end, size, nflags, pgno)
                if nflags & _F_SUBDATA:
                    if not main or size != _DB:
                        self.fail(f"{name}: page {pgno} has a misplaced database record")
                    sub_root, = struct.unpack_from("<Q", p, end + 40)
                    sub_depth, = struct.unpack_from("<H", p, end + 6)
                    if sub_root != _P_INVALID:
                        key = p[off + _NODE:end].decode("ascii", "replace")
                        self.tree(sub_root, f"database {key!r}", sub_depth)
            # NOTE: LMDB packs a page's nodes from its end down to `upper`, so their sizes add up to
            # exactly psize - upper. A flipped key or data size breaks the sum; LMDB would then
            # move memory by the wrong sizes when it edits the page (heap corruption, an abort at
            # the next free: fault drill, lru leaf).
            if packed != self.psize - upper:
                self.fail(f"{name}: page {pgno} has node sizes adding up to {packed} bytes in a "
                          f"{self.psize - upper}-byte node area")
