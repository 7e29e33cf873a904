"""Where an LMDB store's pages are, for tests that damage one kind of page on purpose.

Reads data.mdb with plain file reads (the layout is in storage/disk/pagewalk.py's docstring):
the newer meta page gives the free-page and main database roots; the main database's leaf
nodes give each named database's root. `pages(path, tree)` lists (page number, flags) of one
tree's branch and leaf pages; `overflow_runs(path, tree)` the first page of each value stored
in overflow pages.
"""
from __future__ import annotations

import struct
from pathlib import Path

from storage.disk.preflight import read_meta_pages

P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02
_INVALID = 0xFFFFFFFFFFFFFFFF


def _meta(path: Path):
    with open(path / "data.mdb", "rb") as f:
        return max((m for m in read_meta_pages(f) if m is not None), key=lambda m: m.txnid)


def read_page(path: Path, pgno: int) -> bytes:
    ps = _meta(path).page_size
    with open(path / "data.mdb", "rb") as f:
        f.seek(pgno * ps)
        return f.read(ps)


def nodes(p: bytes) -> tuple[int, ...]:
    lower, = struct.unpack_from("<H", p, 12)
    return struct.unpack_from(f"<{(lower - 16) // 2}H", p, 16)


def root_of(path: Path, tree: str) -> int:
    """The root page of "free", "main" or a named database ("payload", "meta", "lru", "info")."""
    m = _meta(path)
    if tree == "free":
        return m.free_root
    if tree == "main":
        return m.main_root
    for pgno, flags in pages(path, "main"):
        p = read_page(path, pgno)
        if not flags & P_LEAF:
            continue
        for off in nodes(p):
            nflags, ksize = struct.unpack_from("<HH", p, off + 4)
            if nflags & F_SUBDATA and p[off + 8:off + 8 + ksize] == tree.encode():
                return struct.unpack_from("<Q", p, off + 8 + ksize + 40)[0]
    raise KeyError(tree)


def pages(path: Path, tree: str) -> list[tuple[int, int]]:
    """(page number, flags) of every branch and leaf page of `tree`, root first."""
    root = root_of(path, tree)
    out, todo = [], [] if root == _INVALID else [root]
    while todo:
        pgno = todo.pop()
        p = read_page(path, pgno)
        flags, = struct.unpack_from("<H", p, 10)
        out.append((pgno, flags))
        if flags & P_BRANCH:
            for off in nodes(p):
                lo, hi, nflags = struct.unpack_from("<HHH", p, off)
                todo.append(lo | hi << 16 | nflags << 32)
    return out


def overflow_runs(path: Path, tree: str) -> list[int]:
    """The first page of every overflow run holding one of `tree`'s values."""
    runs = []
    for pgno, flags in pages(path, tree):
        if flags & P_LEAF:
            p = read_page(path, pgno)
            for off in nodes(p):
                nflags, ksize = struct.unpack_from("<HH", p, off + 4)
                if nflags & F_BIGDATA:
                    runs.append(struct.unpack_from("<Q", p, off + 8 + ksize)[0])
    return runs


def patch(path: Path, offset: int, raw: bytes) -> None:
    """Write `raw` at `offset` of data.mdb (a running process's map sees it at once)."""
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(raw)


def page_size(path: Path) -> int:
    return _meta(path).page_size
