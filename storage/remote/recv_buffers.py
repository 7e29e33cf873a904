"""Warm buffers for values read off the network: taken by the reads, given back once decoded.

Why: a block's value is a few hundred KiB to a few MiB. glibc serves allocations that size with
fresh pages (mmap, or heap it trimmed back to the kernel when the previous batch was freed), so a
new buffer per value pays a page fault per 4 KiB every time: on the default model's bf16 blocks
(~360 KiB, 32 per MGET, loopback valkey) the reads ran at 1.1-1.25 GB/s into new bytearrays and
3.9-4.3 GB/s into warm ones. A buffer that comes back here is handed out again, its pages
already mapped.

Knows: the free buffers, by capacity (sizes rounded up to 64 KiB, so values of one layout whose
compressed sizes differ a little share a class), and a bound on the bytes it keeps (beyond it a
returned buffer is simply dropped to the garbage collector). Doesn't know: what the bytes are.

Threads: take() on the fetch threads, give() on the decode threads; `_lock` guards the free
lists only (no I/O, no wait under it).
NOTE invariant: give() a view only when nothing reads it or anything cut from it any more -- the
next take() overwrites it. The remote tier gives a value back after its decode copied it out,
and never one whose payload it handed to a caller (storage/remote/tier.py, _check).
"""
from __future__ import annotations

import threading

_GRAIN = 1 << 16
DEFAULT_MAX_BYTES = 128 << 20   # two MGETs of 2 MiB blocks (a Llama-8B-shaped bf16 block), ~11 of 360 KiB ones


class RecvBuffers:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}
        self._kept = 0                  # bytes in _free
        self.reused = 0                 # takes served from the free lists (for tests and stats)
        self.allocated = 0              # takes that made a new buffer

    def take(self, size: int) -> memoryview:
        """A writable view of exactly `size` bytes (its contents are whatever was there)."""
        cap = max(_GRAIN, -(-size // _GRAIN) * _GRAIN)
        with self._lock:
            free = self._free.get(cap)
            buf = free.pop() if free else None
            if buf is not None:
                self._kept -= cap
                self.reused += 1
            else:
                self.allocated += 1
        if buf is None:
            buf = bytearray(cap)
        return memoryview(buf)[:size]

    def give(self, view: object) -> None:
        """Hand back a view take() made (anything else, e.g. redis-py's bytes, is ignored)."""
        if not isinstance(view, memoryview) or not isinstance(view.obj, bytearray):
            return
        buf = view.obj
        cap = len(buf)
        if cap % _GRAIN:
            return                      # not one of ours
        with self._lock:
            if self._kept + cap <= self.max_bytes:
                self._free.setdefault(cap, []).append(buf)
                self._kept += cap

    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept
