"""A file's pages dropped from the OS page cache, and how much of it is still there.

Knows: posix_fadvise(POSIX_FADV_DONTNEED) on a whole file (any user may do it; the kernel drops
the file's clean pages that no process maps -- a page mapped in some process stays, so this
process's own maps of the file are emptied first with madvise(MADV_DONTNEED), as reclaim would
unmap them: an LMDB reader maps its whole data file; a private map of the file is left alone, its
copied pages are not the file's), and mincore over a shared read-only map of the file made for the
question (which pages are resident). What "cold" means for a
benchmark that asks for it: every byte read next comes from the drive, or the figure says how much
did not. Doesn't know: tieredkv or LMCache (tools/lmcache_peer.py imports this from LMCache's own
environment: the standard library only), or the drive's cache below the OS (a VM's host may hold
the bytes: a "cold" read here is cold for this kernel).

    drop(paths) -> (files, bytes, resident bytes after)   every regular file under each path
                                                         (mapped by another process: stays)
    resident(path) -> bytes of the file in the page cache
"""
from __future__ import annotations

import ctypes
import mmap
import os

_PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def resident(path: str) -> int:
    """Bytes of `path` in the page cache now (mincore over a map made for the question and
    unmapped: mapping a file reads none of it)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap({path})")
        try:
            vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore({path})")
            return min(size, sum(v & 1 for v in vec) * _PAGE)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _maps_of(path: str) -> list[tuple[int, int]]:
    """(address, length) of every shared map of the file `path` in this process (/proc/self/maps)."""
    st = os.stat(path)
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if (len(fields) == 6 and int(fields[4]) == st.st_ino and fields[1][3] == "s"
                    and fields[5].rstrip("\n") == os.path.realpath(path)):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.append((lo, hi - lo))
    return found


def _unmap_pages(path: str) -> int:
    """This process's page-table entries for `path` dropped (madvise MADV_DONTNEED over its maps of
    the file: the next touch faults the page in again, from the page cache or the drive; a shared
    file map's contents are the file's, so nothing is lost). Returns the bytes of map covered."""
    covered = 0
    for addr, length in _maps_of(path):
        if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({path})")
        covered += length
    return covered


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _dirs, names in os.walk(p):
                out.extend(os.path.join(root, n) for n in sorted(names))
        elif os.path.isfile(p):
            out.append(p)
    return [f for f in out if os.path.isfile(f) and not os.path.islink(f)]


def drop(paths: list[str]) -> tuple[int, int, int]:
    """Every regular file under `paths` synced and dropped from the page cache: (files, their bytes,
    bytes still resident after -- pages mapped by a process, or written back too late)."""
    files, total, left = 0, 0, 0
    for path in _files(paths):
        _unmap_pages(path)              # a page this process maps is not dropped
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)            # a dirty page cannot be dropped: written first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        files += 1
        total += os.path.getsize(path)
        left += resident(path)
    return files, total, left
