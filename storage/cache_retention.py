"""Retention wired into the tiers (issue 39, item 1): a base class of TieredKVCache.

Knows: which tier keeps retained blocks -- the lowest local tier: the disk (its rows, read back at
start, make its evictions pass a retained block over: storage/disk/room.py), else the host slab
(storage/host_tier.py's `keep`); with neither, retention is off and every ask is refused -- the
bound (CacheConfig.max_retained, by default half that tier, and max_retained_per_tenant), and that
a retained block must reach the disk before the slab above may drop it: it is written through as
soon as it is computed (Cascade.retained), and blocks retained while they sit in the pool or the
slab are sent down at once.
Doesn't know: requests or billing (the engine asks `retain` and turns the outcome into usage),
or how a tier stores its rows.

Threads: `retain` from any thread (the engine's callers, at submit): the book's own leaf lock,
then the tiers' lock only to send blocks down (reserve and copy, as write-through does).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from storage.hashing import BlockKey
from storage.lower_tier import LowerTier
from storage.retention import RetainOutcome, RetainRow, Retention

log = logging.getLogger(__name__)

__all__ = ["CacheRetention"]


class CacheRetention:
    """Mixed into TieredKVCache (its `tiers`, `config`, `layout`, `cascade`, `_lock`)."""

    def _start_retention(self, clock: Callable[[], float] | None) -> None:
        """Once, after the tiers are built: the keeping tier chosen, its rows read back."""
        clock = clock or time.time
        keeper: LowerTier | None = next((t for t in self.tiers.lower if t.local), None)
        if keeper is not None:
            room = int(getattr(keeper, "capacity_bytes", self.config.disk_bytes))
        elif self.tiers.host.enabled:
            room = self.tiers.host.num_slots * self.layout.nbytes
        else:
            room = 0
        bound = self.config.max_retained_bytes
        bound = room // 2 if bound is None else min(bound, max(0, room - self.layout.nbytes))
        per_tenant = self.config.max_retained_per_tenant_bytes
        self.retention = Retention(self.layout.nbytes, bound, bound if per_tenant is None else per_tenant, clock)
        self._keeper = keeper
        if keeper is not None:
            rows = keeper.open_retention(clock, self.retention.unwritten)
            over = self.retention.load(rows)
            if over:      # written under a larger configuration: the disk keeps no more than the book
                keeper.retain([RetainRow(r.block_hash, r.tenant, 0.0, r.klass) for r in over])
            if rows:
                log.info("retention: %d retained block row(s) read back from the %s tier, %d live (%d over "
                         "this configuration's bounds, forgotten)", len(rows), keeper.name,
                         self.retention.blocks(), len(over))
            self.cascade.retained = self.retention.live      # written through once computed
        if self.tiers.host.enabled and self.retention.enabled:
            self.tiers.host.keep = self._keep_in_host

    def retain(self, tenant: str, keys: Sequence[BlockKey], klass: str) -> RetainOutcome:
        """Keep these blocks (a prompt's chain, in order) for `tenant` under retention class
        `klass` ("5m", "1h", "24h"): not evicted from the lowest local tier before the deadline.
        With retention off, or past a bound, the blocks are refused (served and cached as ever)."""
        if not keys:
            return RetainOutcome()
        if not self.retention.enabled:
            return RetainOutcome(refused=len(keys))
        outcome = self.retention.retain(tenant, keys, klass)
        if self._keeper is not None and outcome.rows:
            self._keeper.retain(outcome.rows)
            self._send_down(list(keys[:outcome.retained]))
        return outcome

    def _keep_in_host(self, key: BlockKey, slot: int) -> bool:
        """Whether the slab passes this block over when evicting (engine thread, tiers' lock held):
        a retained block where the slab is the lowest local tier, or one the disk does not hold
        yet (its write dropped by a full queue, or not reached): it is queued for the disk again
        here and kept until the disk has it. A slab of nothing but such blocks still evicts
        (HostTier.evict_lru): the slab's capacity wins."""
        if not self.retention.live(key.hash):
            return False
        keeper = self._keeper
        if keeper is None:
            return True
        if keeper.contains(key):
            return False
        self.cascade.host_to_lower(key, slot)
        return not keeper.contains(key)

    def _send_down(self, keys: list[BlockKey]) -> None:
        """Retained blocks the pool or the slab holds and the keeping tier does not: written down
        now (as write-through would), so no eviction above can drop them first."""
        keeper = self._keeper
        if not self.tiers.host.enabled:
            return        # new blocks go down as they are computed (Cascade.registered); none copied here
        with self._lock:
            t = self.tiers
            on_device, in_host = [], []
            for k in keys:
                if keeper.contains(k):
                    continue
                if t.host.slot_of(k) is not None:
                    in_host.append(k)
                elif (page := t.pool.page_of(k)) is not None:
                    on_device.append((k, page))
            if on_device:
                self.cascade.device_to_host(on_device, through=True)
            if in_host:
                self.cascade.writeback.submit(in_host)

    def retention_status(self) -> dict:
        """What /v1/cache/status and /metrics show: the bound, the blocks kept, each tenant's."""
        r = self.retention
        return {"enabled": r.enabled, "keeper": self._keeper.name if self._keeper is not None
                else ("host" if self.tiers.host.keep is not None else None),
                "max_bytes": r.max_bytes, "per_tenant_bytes": r.per_tenant_bytes, "blocks": r.blocks(),
                "expired": r.expired, "refused": r.refused,
                "tenants": {t: v.to_dict() for t, v in sorted(r.tenants().items())}}
