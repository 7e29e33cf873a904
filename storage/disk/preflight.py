"""Checks on an LMDB environment's files made before LMDB maps them, and moving a damaged one aside.

Knows: the layout of LMDB's two meta pages at the start of data.mdb (magic, version, page size,
map size, the main database's root page, the last page number, the transaction id) and what
follows from it: a file shorter than its newer meta page's last page is truncated, and mapping
it would end in SIGBUS on the first read past the end; a meta page with a bad magic or version
makes LMDB refuse to open at all; a main-database root that is not a branch or leaf page inside
the file means the index is damaged (a writable open would come up silently empty).
Doesn't know: our databases or records (storage/disk/records.py), or what the caller does about
damage -- DiskTier moves a damaged writable tier aside and starts a fresh one (loud log, status
field); a readonly open (verify, inspect) refuses with the reason.

LMDB 0.9 on-disk layout, little-endian, offsets from the start of a meta page:
    page header  pgno u64 @0, flags u16 @10 (P_META = 0x08)
    mm_magic u32 @16 (0xBEEFC0DE), mm_version u32 @20 (1), mm_mapsize u64 @32,
    mm_dbs[0] (free db) @40 -- its first u32 (md_pad) holds the page size; md_root u64 @80,
    mm_dbs[1] (main db) @88 -- md_root u64 @128,
    mm_last_pg u64 @136, mm_txnid u64 @144
Meta page 0 is at offset 0, meta page 1 at offset `page size`.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from dataclasses import dataclass
from typing import Iterator

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_BRANCH, _P_LEAF, _P_META = 0x01, 0x02, 0x08
_P_INVALID = 0xFFFFFFFFFFFFFFFF
_META_BYTES = 152
# Beside a disk dir `<path>`: its open lock `<path>.open-lock` (`opening`) and a damaged
# environment moved aside, `<path>.damaged-<UTC stamp>-<pid>` (`move_aside`). Named here so
# whoever owns a directory holding a disk dir (the demo) can tell these from foreign files.
LOCK_SUFFIX = ".open-lock"
ASIDE_INFIX = ".damaged-"


class DamagedEnvironment(RuntimeError):
    """An LMDB environment that must not be mapped or used: truncated, bad meta, damaged root."""


@dataclass(frozen=True, slots=True)
class MetaPage:
    page_size: int
    map_size: int
    main_root: int
    last_page: int
    txnid: int
    free_root: int = _P_INVALID
    free_depth: int = 0
    main_depth: int = 0


def _read_meta(f, offset: int, index: int) -> MetaPage | None:
    f.seek(offset)
    return parse_meta(f.read(_META_BYTES), index)


def parse_meta(p: bytes, index: int) -> MetaPage | None:
    """Meta page `index` (0 or 1) from its first bytes, None when they are not a sound one."""
    if len(p) < _META_BYTES:
        return None
    pgno, = struct.unpack_from("<Q", p, 0)
    flags, = struct.unpack_from("<H", p, 10)
    magic, version = struct.unpack_from("<II", p, 16)
    page_size, = struct.unpack_from("<I", p, 40)
    map_size, = struct.unpack_from("<Q", p, 32)
    main_root, = struct.unpack_from("<Q", p, 128)
    free_root, = struct.unpack_from("<Q", p, 80)
    last_page, txnid = struct.unpack_from("<QQ", p, 136)
    free_depth, = struct.unpack_from("<H", p, 46)
    main_depth, = struct.unpack_from("<H", p, 94)
    if (pgno != index or not flags & _P_META or magic != _MAGIC or version != _DATA_VERSION
            or page_size < 512 or page_size > 65536 or page_size & (page_size - 1)):
        return None
    return MetaPage(page_size, map_size, main_root, last_page, txnid, free_root, free_depth, main_depth)


def read_meta_pages(f) -> tuple[MetaPage | None, MetaPage | None]:
    """Both meta pages of an open data.mdb (None for a damaged one), read with the file's own
    reads, never through a map."""
    first = _read_meta(f, 0, 0)
    return first, (None if first is None else _read_meta(f, first.page_size, 1))


def check_environment(path: str) -> MetaPage | None:
    """The newer meta page of `path`/data.mdb when the file is sound enough to map; None when
    there is no data yet (a new environment). Raises DamagedEnvironment with the reason."""
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
    except FileNotFoundError:
        return None
    if size == 0:
        return None       # created, never committed: LMDB initialises it
    with open(data, "rb") as f:
        first = _read_meta(f, 0, 0)
        if first is None:
            raise DamagedEnvironment(f"{data}: meta page 0 is damaged (bad magic, version or page size)")
        second = _read_meta(f, first.page_size, 1)
        if second is None:
            raise DamagedEnvironment(f"{data}: meta page 1 is damaged (bad magic, version or page size)")
        meta = max(first, second, key=lambda m: m.txnid)
        need = (meta.last_page + 1) * meta.page_size
        if size < need:
            raise DamagedEnvironment(f"{data}: truncated: {size} bytes, its meta page says {need}")
        if meta.main_root != _P_INVALID:
            if meta.main_root > meta.last_page:
                raise DamagedEnvironment(f"{data}: main database root page {meta.main_root} is past the "
                                         f"last page {meta.last_page}")
            f.seek(meta.main_root * meta.page_size)
            header = f.read(12)
            pgno, = struct.unpack_from("<Q", header, 0)
            flags, = struct.unpack_from("<H", header, 10)
            if pgno != meta.main_root or not flags & (_P_BRANCH | _P_LEAF):
                raise DamagedEnvironment(f"{data}: main database root page {meta.main_root} is damaged")
    return meta


def move_aside(path: str, reason: str) -> str:
    """Rename a damaged environment directory out of the way; returns the new path. The bytes
    are kept for a post-mortem (and `tieredkv verify` on them); nothing is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{path}{ASIDE_INFIX}{stamp}-{os.getpid()}"
    n = 1
    while os.path.exists(aside):      # a second store damaged within the same second
        aside = f"{path}{ASIDE_INFIX}{stamp}-{os.getpid()}-{n}"
        n += 1
    os.rename(path, aside)
    with open(os.path.join(aside, "DAMAGED.txt"), "w") as f:
        f.write(reason + "\n")
    return aside


@contextlib.contextmanager
def opening(path: str) -> Iterator[None]:
    """An exclusive lock (a file beside the directory) held while one process checks, moves aside
    and opens the environment, so two processes starting at once never both move it aside (the
    second would move the first's fresh environment)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the lock
