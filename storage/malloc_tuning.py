"""glibc's malloc, told to keep the block-sized memory it frees rather than hand it back to the kernel.

Why: the lower tiers allocate and free buffers the size of a KV block (a few hundred KiB to a few
MiB) by the thousand -- zstd frames, joined values, received values, decoded planes -- a batch at a
time. glibc serves any allocation of 128 KiB or more (its default, adjusted upward only as large
blocks come and go) with fresh pages from the kernel (mmap), and gives the top of its heap back
(trim) once 128 KiB of it is free, so the next batch page-faults every 4 KiB in again. Measured
here: encoding and joining a batch of 32 bf16 blocks of the default model cost 475 us a block
with glibc's defaults and 370 us with these settings (~1.3x); an MGET reply's values received into
new buffers ran at a third of the speed of warm ones (storage/remote/recv_buffers.py keeps its own).
jemalloc and tcmalloc keep such memory on their own; glibc needs to be told.

What it sets (once per process, before the tiers allocate): M_MMAP_THRESHOLD 4 MiB (allocations
below it come from the heap and are reused; a pool or a tensor of several MiB still gets its own
mapping, returned when freed) and M_TRIM_THRESHOLD 64 MiB (the heap keeps up to that much free
memory at its top). The cost is that: up to 64 MiB per malloc arena stays mapped after a burst.

Knows: glibc's mallopt and these two parameters. Doesn't know: the tiers (storage/disk/tier.py and
storage/remote/tier.py call `keep_freed_memory()` when they are built). Leaves malloc alone when
not on glibc (musl, macOS), when TIEREDKV_MALLOC_TUNING=0, or when the user set glibc's own
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (their choice stands).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1          # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 64 << 20

_lock = threading.Lock()
_result: bool | None = None     # None: not tried yet


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True when they are in force (set now or before)."""
    global _result
    with _lock:
        if _result is None:
            _result = _apply()
        return _result


def _apply() -> bool:
    if os.environ.get("TIEREDKV_MALLOC_TUNING", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False                # the user tuned glibc themselves
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("malloc tuning: mmap threshold %d, trim threshold %d: %s", MMAP_THRESHOLD, TRIM_THRESHOLD,
              "set" if ok else "refused")
    return ok


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version          # glibc only: musl and others have no such symbol
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None
