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

The callers (storage/tiered_cache.py, cascade.py, loader.py) walk `Tiers.lower` and never name a
tier: what differs between tiers is said here, by the tier -- `local` (its own tier, or a store
shared over a link), probe, room, clear, the payloads it forwards to the tier below (on_commit),
what it keeps of a read from the tier below (keep), a read given up (read_late), and its counters
as a record the cache reports without knowing its fields (TierRecord). Only the wiring that
builds the tiers from CacheConfig (storage/tier_wiring.py) names them; tests/storage/
test_tier_boundary.py keeps it so. A verb with a default below is one a tier may leave as it is
(a tier subclasses LowerTier to inherit them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

from storage.cancellation import Cancellation
from storage.hashing import BlockKey
from storage.retention import RetainRow
from storage.tier_kinds import TierKind

if TYPE_CHECKING:      # the disk tier opened for inspection (`tieredkv inspect`, `verify`) loads no torch
    import torch


def owned_or_copied(block: torch.Tensor, owned: bool) -> torch.Tensor:
    """put()'s block: the caller's own when it handed it over (`owned`) and it is contiguous on the
    CPU, else private_copy(block)."""
    if owned and plain_cpu(block) and not block.is_pinned():   # pinned (a CUDA batch copied out): not kept
        return block.detach()
    return private_copy(block)


def plain_cpu(block: torch.Tensor) -> bool:
    """Its bytes are its values, in element order, in CPU memory: one memcpy copies it."""
    return block.device.type == "cpu" and block.is_contiguous() and not block.is_conj() and not block.is_neg()


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
    if plain_cpu(src):
        out.reshape(-1).view(torch.uint8).numpy()[:] = src.reshape(-1).view(torch.uint8).numpy()
    else:
        out.copy_(src)
    return out


@runtime_checkable
class TierRecord(Protocol):
    """A lower tier's counters (DiskStats, RemoteStats): a typed record the cache reports (cache
    status, /metrics) without knowing its fields."""

    def report(self, into) -> None:
        """Write this record into `into` (storage/tiers.py's TierStats): the shared fields it
        knows (capacity_bytes, used_bytes, blocks, evictions, ...) and the rest as `into.extra`,
        under the names cache status shows."""


@runtime_checkable
class LowerTier(Protocol):
    kind: TierKind  # what it is (storage/tier_kinds.py): its name, medium, price, readiness, calibration
    name: str       # kind.name ("disk", "remote"): the tier's name in stats, billing, metrics and the CLI
    local: bool     # kind.local: this process's own tier: contains() is the whole answer (no probe), its writer
                    # always drains (a put may wait for room), and clear() empties it. False: a store
                    # shared over a link (asked with probe(), waits bounded, never cleared from here)
    events: object  # the KV-event hook (storage/kv_events/sink.py), set by the cache: the tier says its own

    def contains(self, key: BlockKey) -> bool:
        """Whether this tier holds the block, as far as this process knows without I/O."""

    def available(self) -> bool:
        """Whether a call may be made now (False while a store's breaker is open)."""
        return True

    def probe(self, keys: Sequence[BlockKey]) -> frozenset[bytes]:
        """The hashes of the longest prefix of `keys` (a chain) this tier holds: one bounded round
        trip for a tier over a link, so never on the engine thread."""
        held = set()
        for key in keys:
            if not self.contains(key):
                break
            held.add(key.hash)
        return frozenset(held)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None,
                 payloads: list | None = None, cancel: Cancellation | None = None) -> list[torch.Tensor | None]:
        """Verified blocks for `keys` (None: a miss); `outs` receive the bytes; `payloads`, when
        given, each hit's verified codec payload (so another tier can keep it without encoding).
        `cancel` (storage/cancellation.py): once cancelled, a tier that reads over a link stops
        (what arrived whole is still served, the rest are misses) and frees the link; a local
        tier may ignore it (its read is bounded by the drive and takes no link)."""

    def put(self, key: BlockKey, block: torch.Tensor | None = None, *, wait: bool,
            timeout: float | None = None, payload: bytes | None = None, raw_size: int = 0,
            owned: bool = False) -> bool:
        """Queue a block for writing: its bytes (`block`), or its payload already encoded and
        bound to hash || namespace (`payload`, `raw_size` its decoded bytes). wait=True waits
        for room in the queue (up to `timeout`). False: not queued. (Each tier has its own
        default for `wait`; the cache always says.) `block` is copied before put returns
        (private_copy) unless `owned`: the caller hands over a contiguous CPU tensor that nothing
        else writes (a private_copy of its own, e.g. the cascade's copies out), kept as it is."""

    def delete(self, key: BlockKey) -> bool:
        """Remove the block. True when there was one."""

    def drain(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Wait until every queued write landed; False when one was lost (while waiting, or since
        `since`, a write_failures() mark) or the wait timed out."""

    def write_failures(self) -> int:
        """Writes lost so far: a mark for drain(since=...), taken before queueing."""

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Wait until the write queue is below its bound (a caller holding no lock, between
        batches of puts that never wait). A tier over a link answers at once: its queue drops."""
        return True

    def clear(self) -> int:
        """Forget every block (pending writes included); returns how many stored blocks went."""

    def read_ahead(self, keys: Sequence[BlockKey]) -> int:
        """Warm what a read of these blocks will touch (the OS page cache), decoding nothing: a
        prefetch with no host tier to decode into. Returns bytes read; never raises."""
        return 0

    def keep(self, kept: Sequence[tuple[BlockKey, torch.Tensor, bytes | None]]) -> int:
        """Blocks just read from the tier below this one (key, its bytes on the CPU, the payload
        that tier verified): this tier keeps a copy, so the next miss stays closer. The payload
        is stored as it is (a block is not encoded twice). Never waits: a full queue drops
        (counted). Returns the blocks queued."""
        return sum(1 for key, block, payload in kept
                   if not self.contains(key) and self.put(key, block, wait=False, payload=payload))

    def on_commit(self, callback: Callable[[list], None]) -> bool:
        """Have `callback([(key, payload, raw_size), ...])` called with each batch of blocks this
        tier stored (on its writer's thread), so the tier below is written from them (encoded
        once). False: this tier forwards nothing."""
        return False

    def retain(self, rows: Sequence[RetainRow]) -> bool:
        """Keep these retention deadlines (storage/retention.py) with the blocks, so that this
        tier, evicting, passes a block over until its deadline, also after a restart. False: this
        tier keeps none (a store shared over a link: retention is the lowest local tier's)."""
        return False

    def open_retention(self, clock: Callable[[], float],
                       lost: Callable[[list[RetainRow]], None] | None = None) -> list[RetainRow]:
        """Once, at start: the retention deadlines this tier kept (a restart's), the clock
        (wall-clock seconds) its deadlines are judged by from now on, and `lost`, told of rows
        retain() took that could not be written (a deadline <= 0 in a row: forget that entry)."""
        return []

    def link_probe(self):
        """A linked tier's link measured (kind.calibrates == "link"): a round trip and a
        block-sized read, as figures with `bytes_per_s`, `rtt_s` and `points()` (storage/remote/
        link_probe.py's LinkFigures); None when it did not answer or measures none. Bounded by
        the tier's own timeouts; never on the engine thread."""
        return None

    def read_late(self) -> None:
        """A read from this tier outlived the deadline of the load waiting for it (storage/
        load_outcome.py): a tier over a link counts it against the link (its breaker)."""

    def iter_blocks(self) -> Iterator:
        """The blocks this tier holds (records with hash, parent, namespace, token_ids, hits),
        read in chunks. A store shared with other servers lists none: what it holds is the
        store's (`tieredkv inspect --remote-url`)."""
        return iter(())

    def announce(self, keys: Sequence[BlockKey]) -> None:
        """A KV event (BlockStored) for each of these blocks the tier still holds: what
        iter_blocks() listed at start (storage/tiered_cache.py announces them)."""

    def stats(self) -> TierRecord:
        """This tier's counters (DiskStats, RemoteStats)."""

    def close(self) -> None:
        """Write what is queued (bounded), then release everything."""
