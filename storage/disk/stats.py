"""The disk tier's counters as it reports them: the store's (shared by every process, from
`info`) and this process's own, and one stored block's metadata as iter_blocks() lists it.

Knows: the fields and what each counts, and how cache status shows them (DiskStats.report).
Doesn't know: how they are kept (storage/disk/tier.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from storage.codec.encode_process import EncodeProcessStats


@dataclass(frozen=True, slots=True)
class DiskStats:
    capacity_bytes: int
    used_bytes: int
    raw_bytes: int
    blocks: int
    compression_ratio: float
    store_hits: int            # gets this process made that found the block (TierStats.hits: blocks served)
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
    writes_off: str | None = None  # why it writes nothing now (its directory takes no writes; it still serves), or None
    writes_off_drops: int = 0      # blocks not written because the writes were off
    free_bytes: int | None = None  # the filesystem's free space, as the writer last saw it
    space_bound_bytes: int | None = None  # the bound the free space set below the capacity, if lower
    # The writer's encode process (storage/codec/encode_process.py): its starts, deaths (killed or
    # hung with a batch: that batch encoded in this process), failed starts, blocks it handed back;
    # None while it was never used (off, or nothing written yet).
    encode_process: EncodeProcessStats | None = None

    def report(self, into) -> None:
        """Into the cache's TierStats for the disk (storage/lower_tier.py's TierRecord): the shared
        fields, and the rest under the names cache status shows (stored_bytes_written: the bytes
        the writer stored; the cache counts the blocks it sent down itself)."""
        into.capacity_bytes, into.used_bytes, into.blocks = self.capacity_bytes, self.used_bytes, self.blocks
        into.evictions, into.bytes_read = self.evictions, self.bytes_read
        into.extra = {"enabled": True, "compression_ratio": self.compression_ratio,
                      "pending_writes": self.pending_writes, "corrupt": self.corrupt, "write_errors": self.write_errors,
                      "read_errors": self.read_errors, "recovered": self.recovered, "moved_aside": self.moved_aside,
                      "unavailable": self.unavailable, "writes_off": self.writes_off,
                      "writes_off_drops": self.writes_off_drops, "free_bytes": self.free_bytes,
                      "space_bound_bytes": self.space_bound_bytes, "raw_bytes": self.raw_bytes,
                      "stored_bytes_written": self.bytes_written,
                      "encode_process": None if self.encode_process is None else asdict(self.encode_process)}


@dataclass(frozen=True, slots=True)
class DiskBlockInfo:
    hash: bytes
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    raw_size: int
    stored_size: int
    reads: int                 # gets that returned it (BlockMeta.reads)
    last_access: int
    created: float


@dataclass(slots=True)
class _Counters:
    store_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    read_errors: int = 0
    queue_full_drops: int = 0
    moved_aside: int = 0
    writes_off_drops: int = 0
