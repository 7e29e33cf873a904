"""The wiring: the tiers below the host built from CacheConfig, in order, and what the config says
about them that the cache passes on without naming them.

Knows: which tiers there are and their order (the disk, then the remote store, and any a line
added: add_tier), how each is built
from CacheConfig (path, sizes, codec -- "auto" chosen here, storage/codec_choice.py --, reserve;
URL, timeouts, TTL, breaker), what a configured
tier that could not start reports (a disk on a full filesystem: `unavailable`), the store's write
policy (`remote_write`: write-through sends every block down as it is registered), and the
handles by name (`cache.disk`, `cache.remote`) that callers outside placement use: the engine's
calibration and start-up line, the CLI, tools and tests.
Doesn't know: placement or movement. storage/tiered_cache.py, cascade.py and loader.py walk
`Tiers.lower` through storage/lower_tier.py's verbs and name no tier (tests/storage/
test_tier_boundary.py): this module is the one place in placement that does.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from storage.codec.payload import Codec
from storage.codec_choice import choose_for_disk
from storage.config import CacheConfig
from storage.disk.seal import DiskSeal
from storage.disk.tier import DiskTier, DiskUnavailable
from storage.layout import BlockLayout
from storage.lower_tier import LowerTier
from storage.remote.breaker import BreakerConfig
from storage.fleet_secret import load_fleet_secret
from storage.remote.tier import RemoteTier
from storage.tier_kinds import TierKind, kinds, register, unregister

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LowerTiers:
    """The tiers below the host as the cache is given them."""
    tiers: tuple[LowerTier, ...]           # fastest first
    write_through: bool                    # every registered block goes down at once (storage/cascade.py)
    decoders: dict[str, Codec]             # each tier that calibrates by a read (TierKind.calibrates): the
                                           # codec its restores decode with, timed at start for the planner's
                                           # first figure (storage/restore_rates.py)
    status: dict[str, dict] = field(default_factory=dict)   # per tier name, what its status adds to
                                           # the tier's own record (an absent tier: {"enabled": False, ...})


# Tiers added by a line each (add_tier): built by wire() beside the disk and the store.
_ADDED: list[tuple[TierKind, Callable[[CacheConfig, BlockLayout], LowerTier | None]]] = []


def add_tier(kind: TierKind, build: Callable[[CacheConfig, BlockLayout], LowerTier | None],
             after: str | None = None) -> None:
    """The one line that adds a tier below the host: its kind registered (storage/tier_kinds.py:
    billing, usage, metrics, the CLI, KV events, the planner and deadlines read it from there) and
    how it is built from CacheConfig (None: not configured). Every cache wired afterwards has it,
    in its kind's place (`after`: the kind it is slower than)."""
    register(kind, after)
    _ADDED.append((kind, build))


def remove_tier(kind: TierKind) -> None:
    """Undo add_tier (a test's tier, when it ends)."""
    _ADDED[:] = [(k, b) for k, b in _ADDED if k != kind]
    unregister(kind)


def wire(config: CacheConfig, layout: BlockLayout, disk: DiskTier | None = None,
         remote: RemoteTier | None = None) -> LowerTiers:
    """The tiers CacheConfig asks for, each built unless given ready-made (tests, tools)."""
    unavailable: str | None = None          # why the configured disk tier is not running
    kind, chosen = config.codec, None
    if kind == "auto":
        kind = "zstd"                       # fewest bytes: the store's, without a disk to follow
        if disk is None and config.disk_path is not None:
            chosen = choose_for_disk(layout, os.path.dirname(os.path.abspath(config.disk_path)),
                                     os.cpu_count() or 1)
            kind = chosen.kind
    if disk is None and config.disk_path is not None:
        try:
            disk = DiskTier(config.disk_path, config.disk_bytes, Codec(config.zstd_level, kind),
                            layout=layout, reserve_bytes=config.disk_reserve_bytes,
                            stall_s=config.disk_stall_s,
                            seal=DiskSeal(load_fleet_secret(config.cache_secret_file)) if config.seal_disk else None)
        except DiskUnavailable as e:
            # NOTE: a full filesystem (or a store that cannot be created) is a cache without its
            # disk tier, never a server that cannot start; status says why.
            log.error("disk tier unavailable, running without it: %s", e)
            unavailable = str(e)
    if config.codec == "auto" and disk is not None:
        kind = disk.codec.kind              # the store keeps the disk's payloads (storage/disk/writer.py)
    if remote is None and config.remote is not None:
        remote = RemoteTier(config.remote, layout, Codec(config.zstd_level, kind),
                            secret=load_fleet_secret(config.cache_secret_file), timeout_s=config.remote_timeout_s, ttl_s=config.remote_ttl_s,
                            breaker=BreakerConfig(cooldown_s=config.remote_retry_s))
    status = {"disk": ({"codec_choice": chosen.describe()} if chosen is not None else {}) if disk is not None
              else {"enabled": False, "unavailable": unavailable},
              "remote": {"write_policy": config.remote_write} if remote is not None else {"enabled": False}}
    built = [t for t in (disk, remote) if t is not None]
    for kind, build in _ADDED:
        tier = build(config, layout)
        status[kind.name] = {} if tier is not None else {"enabled": False}
        if tier is not None:
            built.append(tier)
    order = [k.name for k in kinds()]
    built.sort(key=lambda t: order.index(t.name) if t.name in order else len(order))   # fastest first
    return LowerTiers(tiers=tuple(built),
                      write_through=config.write_policy == "write_through"
                      or (remote is not None and config.remote_write == "write_through"),
                      decoders={t.name: t.codec for t in built if t.kind.calibrates == "read"},
                      status=status)


class NamedTiers:
    """The tiers below the host by name, for callers outside placement (a base class of
    TieredKVCache, whose `tiers` it reads): None when the tier is not running."""
    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.below("disk")

    @property
    def remote(self) -> RemoteTier | None:
        return self.tiers.below("remote")
