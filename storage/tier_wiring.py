"""The wiring: the tiers below the host built from CacheConfig, in order, and what the config says
about them that the cache passes on without naming them.

Knows: which tiers there are and their order (the disk, then the remote store, and any a line
added), each registered by one `add_tier` line -- the house's own as any other -- with how it is
built from CacheConfig (path, sizes, codec -- "auto" chosen here, storage/codec_choice.py --,
reserve; URL, timeouts, TTL, breaker), what a configured
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
from storage.tier_kinds import DISK, REMOTE, TierKind, kinds, register, unregister

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


@dataclass
class Wiring:
    """What a tier's build is handed, and what it leaves for the builds after it and the cache.
    Builds run in registration order (the disk's before the store's), on the wiring thread."""
    config: CacheConfig
    layout: BlockLayout
    given: dict[str, LowerTier]            # ready-made tiers by name (tests, tools): used, not built
    codec: str                             # the codec kind the tiers write ("auto": the disk's choice)
    write_through: bool                    # LowerTiers.write_through, as the builds leave it
    status: dict[str, dict] = field(default_factory=dict)   # LowerTiers.status; a build's silence:
                                           # {} when it built its tier, {"enabled": False} when not


Build = Callable[[Wiring], "LowerTier | None"]
_BUILDS: list[tuple[TierKind, Build]] = []     # registration order: each build sees the earlier ones' word


def add_tier(kind: TierKind, build: Build, after: str | None = None) -> None:
    """The one line that adds a tier below the host: its kind registered (storage/tier_kinds.py:
    billing, usage, metrics, /ready, the CLI, KV events, the router, the planner and deadlines
    read it from there) and how it is built (None: not configured; `Wiring` hands it the config).
    Every cache wired afterwards has it, in its kind's place (`after`: the kind it is slower than)."""
    register(kind, after)
    _BUILDS.append((kind, build))


def remove_tier(kind: TierKind) -> None:
    """Undo add_tier (a test's tier, when it ends; the house's own are never removed)."""
    unregister(kind)
    _BUILDS[:] = [(k, b) for k, b in _BUILDS if k != kind]


def wire(config: CacheConfig, layout: BlockLayout, disk: DiskTier | None = None,
         remote: RemoteTier | None = None) -> LowerTiers:
    """The tiers CacheConfig asks for, each built by its registered build unless given ready-made
    (tests, tools), fastest first."""
    w = Wiring(config, layout, given={n: t for n, t in (("disk", disk), ("remote", remote)) if t is not None},
               codec="zstd" if config.codec == "auto" else config.codec,   # fewest bytes, without a disk to follow
               write_through=config.write_policy == "write_through")
    built = []
    for kind, build in list(_BUILDS):
        tier = build(w)
        w.status.setdefault(kind.name, {} if tier is not None else {"enabled": False})
        if tier is not None:
            built.append(tier)
    order = [k.name for k in kinds()]
    built.sort(key=lambda t: order.index(t.name) if t.name in order else len(order))   # fastest first
    return LowerTiers(tiers=tuple(built), write_through=w.write_through,
                      decoders={t.name: t.codec for t in built if t.kind.calibrates == "read"},
                      status=w.status)


def build_disk(w: Wiring) -> DiskTier | None:
    """The disk tier (config.disk_path), its codec chosen here when "auto"; a disk that cannot open
    is a cache without it (its status says why), never a server that cannot start."""
    config, disk, chosen = w.config, w.given.get("disk"), None
    if disk is None and config.disk_path is not None:
        if config.codec == "auto":
            chosen = choose_for_disk(w.layout, os.path.dirname(os.path.abspath(config.disk_path)),
                                     os.cpu_count() or 1)
            w.codec = chosen.kind
        try:
            disk = DiskTier(config.disk_path, config.disk_bytes, Codec(config.zstd_level, w.codec),
                            layout=w.layout, reserve_bytes=config.disk_reserve_bytes,
                            stall_s=config.disk_stall_s,
                            seal=DiskSeal(load_fleet_secret(config.cache_secret_file)) if config.seal_disk else None)
        except DiskUnavailable as e:
            # NOTE: a full filesystem (or a store that cannot be created) is a cache without its
            # disk tier, never a server that cannot start; status says why.
            log.error("disk tier unavailable, running without it: %s", e)
            w.status["disk"] = {"enabled": False, "unavailable": str(e)}
            return None
    if disk is None:
        w.status["disk"] = {"enabled": False, "unavailable": None}
        return None
    if config.codec == "auto":
        w.codec = disk.codec.kind          # the store keeps the disk's payloads (storage/disk/writer.py)
    w.status["disk"] = {"codec_choice": chosen.describe()} if chosen is not None else {}
    return disk


def build_remote(w: Wiring) -> RemoteTier | None:
    """The remote store (config.remote), writing the disk's codec; its write policy said in its status."""
    config, remote = w.config, w.given.get("remote")
    if remote is None and config.remote is not None:
        remote = RemoteTier(config.remote, w.layout, Codec(config.zstd_level, w.codec),
                            secret=load_fleet_secret(config.cache_secret_file), timeout_s=config.remote_timeout_s,
                            ttl_s=config.remote_ttl_s, breaker=BreakerConfig(cooldown_s=config.remote_retry_s))
    if remote is None:
        return None
    w.status["remote"] = {"write_policy": config.remote_write}
    w.write_through = w.write_through or config.remote_write == "write_through"
    return remote


# The house's own tiers, each by the same line a new one takes (their kinds are registered in
# storage/tier_kinds.py already, so the router knows them without this wiring).
add_tier(DISK, build_disk)
add_tier(REMOTE, build_remote)


class NamedTiers:
    """The tiers below the host by name, for callers outside placement (a base class of
    TieredKVCache, whose `tiers` it reads): None when the tier is not running."""
    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.below("disk")

    @property
    def remote(self) -> RemoteTier | None:
        return self.tiers.below("remote")
