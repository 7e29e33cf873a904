"""The disk tier's counters as it reports them: the store's (shared by every process, from
`info`) and this process's own, and one stored block's metadata as iter_blocks() lists it.

Knows: the fields and what each counts. Doesn't know: how they are kept (storage/disk/tier.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiskStats:
    capacity_bytes: int
    used_bytes: int
    raw_bytes: int
    blocks: int
    compression_ratio: float
    hits: int
    misses: int
    corrupt: int
    evictions: int
    bytes_read: int
    bytes_written: int
    write_errors: int
    read_errors: int
    pending_writes: int
    queue_full_drops: int = 0      # blocks the eviction cascade could not queue (queue full)
    recovered: str | None = None   # the last damaged store moved aside (at open or while running): where, and why
    moved_aside: int = 0           # damaged stores this process moved aside and replaced with a fresh one
    unavailable: str | None = None # why the tier has no store now (nothing is read or written), or None
    free_bytes: int | None = None  # the filesystem's free space, as the writer last saw it
    space_bound_bytes: int | None = None  # the bound the free space set below the capacity, if lower


@dataclass(frozen=True, slots=True)
class DiskBlockInfo:
    hash: bytes
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    raw_size: int
    stored_size: int
    hits: int
    last_access: int
    created: float


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    read_errors: int = 0
    queue_full_drops: int = 0
    moved_aside: int = 0
