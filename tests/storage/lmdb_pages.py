"""Where an LMDB store's pages are, for tests that damage one kind of page on purpose: a thin layer
over tools/lmdb_pages.py's classifier (the fault drill's), plus reading and patching pages.

`pages(path, tree)` lists (page number, flags) of one tree's branch and leaf pages, root first
("free" for the free-page database, "main", or a named database); `overflow_runs(path, tree)` the
first page of each of its values stored in overflow pages.
"""
from __future__ import annotations

import struct
from pathlib import Path

from tools.lmdb_pages import classify

P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02


def page_size(path: Path) -> int:
    return classify(str(path)).page_size


def read_page(path: Path, pgno: int) -> bytes:
    ps = page_size(path)
    with open(path / "data.mdb", "rb") as f:
        f.seek(pgno * ps)
        return f.read(ps)


def nodes(p: bytes) -> tuple[int, ...]:
    lower, = struct.unpack_from("<H", p, 12)
    return struct.unpack_from(f"<{(lower - 16) // 2}H", p, 16)


def pages(path: Path, tree: str) -> list[tuple[int, int]]:
    """(page number, flags) of every branch and leaf page of `tree`, root first."""
    pm = classify(str(path))
    db = "freedb" if tree == "free" else tree
    root = pm.records[db].root
    found = [pg for pg, kind in pm.kinds.items() if kind in (f"{db}_branch", f"{db}_leaf")]
    found.sort(key=lambda pg: pg != root)
    return [(pg, struct.unpack_from("<H", read_page(path, pg), 10)[0]) for pg in found]


def overflow_runs(path: Path, tree: str) -> list[int]:
    """The first page of every overflow run holding one of `tree`'s values."""
    return sorted(pg for pg, kind in classify(str(path)).kinds.items() if kind == f"{tree}_ovf_head")


def patch(path: Path, offset: int, raw: bytes) -> None:
    """Write `raw` at `offset` of data.mdb (a running process's map sees it at once)."""
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(raw)
