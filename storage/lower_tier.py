"""What every tier below the host answers: the disk tier (storage/disk/tier.py) and the remote
tier (storage/remote/tier.py), walked by the cache as one list, fastest first.

Knows: the verbs and what each promises, and the private copy a put takes (private_copy).
Doesn't know: any tier's storage, or when a block moves (storage/cascade.py writes down,
storage/loader.py reads up).

NOTE invariants every implementation keeps:
- reads never raise for the store's failures: a block that cannot be read, or fails
  verification, is a miss (None), counted, and deleted when damaged;
- a block served is bit-identical to the block stored, and only served for the key that
  stored it (tokens, namespace and parent checked: storage/codec/stored_block.py);
- put() copies what it is given before it returns (the caller may reuse the memory), and with
  wait=False never waits: a full queue drops the block (counted);
- contains() does no I/O. A `local` tier knows what it holds (the disk's index); the remote
  tier knows only what this process wrote or read, so the cache asks the store itself with a
  probe off the engine thread (TieredKVCache.prefetch) rather than through contains().
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from storage.cancellation import Cancellation
from storage.hashing import BlockKey

if TYPE_CHECKING:      # the disk tier opened for inspection (`tieredkv inspect`, `verify`) loads no torch
    import torch


def private_copy(block: torch.Tensor) -> torch.Tensor:
    """put()'s copy of a block: contiguous, on the CPU, made by the calling thread alone.

    A contiguous CPU block is copied as one memcpy (numpy, GIL released), not with torch's copy_,
    which splits even one block across torch's intra-op threads: with the writers' encode pools
    busy on every core those workers wait for one, and on this loaded 2-core CPU a 360 KiB block
    took ~8 ms to copy instead of ~0.03 ms (tools/bench_write_pool.py). Any other block (on an
    accelerator, or strided) is copied by torch."""
    import torch        # a tensor was given: torch is loaded already
    src = block.detach()
    out = torch.empty(src.shape, dtype=src.dtype)
    if src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg():
        out.reshape(-1).view(torch.uint8).numpy()[:] = src.reshape(-1).view(torch.uint8).numpy()
    else:
        out.copy_(src)
    return out


@runtime_checkable
class LowerTier(Protocol):
    name: str       # "disk" | "remote": the tier's name in stats, billing, metrics and the CLI
    local: bool     # contains() is the whole answer (no probe of a store is needed)

    def contains(self, key: BlockKey) -> bool:
        """Whether this tier holds the block, as far as this process knows without I/O."""

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None,
                 payloads: list | None = None, cancel: Cancellation | None = None) -> list[torch.Tensor | None]:
        """Verified blocks for `keys` (None: a miss); `outs` receive the bytes; `payloads`, when
        given, each hit's verified codec payload (so another tier can keep it without encoding).
        `cancel` (storage/cancellation.py): once cancelled, a tier that reads over a link stops
        (what arrived whole is still served, the rest are misses) and frees the link; a local
        tier may ignore it (its read is bounded by the drive and takes no link)."""

    def put(self, key: BlockKey, block: torch.Tensor | None = None, *, wait: bool,
            timeout: float | None = None, payload: bytes | None = None, raw_size: int = 0) -> bool:
        """Queue a block for writing: its bytes (`block`), or its payload already encoded and
        bound to hash || namespace (`payload`, `raw_size` its decoded bytes). wait=True waits
        for room in the queue (up to `timeout`). False: not queued. (Each tier has its own
        default for `wait`; the cache always says.)"""

    def delete(self, key: BlockKey) -> bool:
        """Remove the block. True when there was one."""

    def flush(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Wait until every queued write landed; False when one was lost (while waiting, or since
        `since`, a write_failures() mark) or the wait timed out."""

    def write_failures(self) -> int:
        """Writes lost so far: a mark for flush(since=...), taken before queueing."""

    def stats(self) -> object:
        """This tier's counters (DiskStats, RemoteStats)."""

    def close(self) -> None:
        """Write what is queued (bounded), then release everything."""
