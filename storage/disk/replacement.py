"""A damaged store replaced while serving: moved aside, a fresh one opened in its place in the same
process, the tier's index with it; and a store another process sharing the directory replaced,
followed.

Knows: when a replacement happens (a transaction's damage, reported by the gate; the writer's
tick, which checks the store's files outside any transaction and follows a fresh store another
process started), how often one process may replace its store before the tier is turned off (a
sick drive), and what is said about it (the log, `recovered`, the moved_aside counter).
Doesn't know: which errors are damage (storage/disk/verdicts.py), how a file is checked
(storage/disk/liveness.py), or how an environment is opened (storage/disk/environment.py).

Threads: runs on the thread that saw the damage (a loader worker, a decode's caller, the writer,
a status read -- never the engine thread, which reads no LMDB) or on the writer's tick; one
replacement at a time (`_lock`), with no transaction of the process open (EnvGate.replace).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from storage.disk.environment import DiskUnavailable, Opened, open_writable
from storage.disk.gate import EnvGate
from storage.disk.index import DiskIndex

__all__ = ["MAX_REPLACEMENTS", "StoreReplacement"]

log = logging.getLogger(__name__)

# Damaged stores one process replaces before it turns its disk tier off (a sick drive).
MAX_REPLACEMENTS = 8


class StoreReplacement:
    """The tier's store, replaced when damaged. `count(**deltas)` receives moved_aside=1 per
    replacement; `replaced()` says how many this process made so far."""

    def __init__(self, path: str, map_size: int, capacity_bytes: int, gate: EnvGate, index: DiskIndex,
                 count: Callable[..., None], replaced: Callable[[], int], recovered: str | None) -> None:
        self.path = path
        self._map_size = map_size
        self._capacity_bytes = capacity_bytes
        self._gate = gate
        self._index = index
        self._count = count
        self._replaced = replaced
        self._lock = threading.Lock()    # one replacement of a damaged store at a time
        self.recovered = recovered       # the last damaged store moved aside: where, and why

    def damaged(self, e: BaseException, generation: int) -> None:
        """The gate's on_damage: a transaction of this process found the store damaged (LMDB's
        MDB_CORRUPTED and kin, StoreDamaged, or its files changed under it). Move it aside and
        open a fresh one in its place, with no transaction open (EnvGate.replace); pending puts
        stay queued and go to the fresh store. Once per damage: a second report of the same store
        finds the generation moved on."""
        reason = f"{type(e).__name__}: {e}"
        with self._lock:
            try:
                opened = self._swap(generation, reason)
            except Exception as err:
                log.error("disk tier %s: the store is damaged (%s) and no fresh one could be opened (%s); "
                          "running without the disk tier", self.path, reason, err)
                self._index.clear()
                return
            if opened is None:
                return
            self.recovered = opened.recovered
            self._count(moved_aside=1)
        log.error("disk tier %s: damaged while in use (%s): %s; serving goes on with an empty disk tier",
                  self.path, reason, opened.recovered)

    def tick(self) -> None:
        """The writer's tick (every few seconds, outside any transaction): the store's files
        checked -- a file shrunk, unlinked or overwritten is damage, the store replaced before a
        reader touches it -- and a store another process sharing the directory moved aside
        followed: data.mdb no longer the file this process maps, the fresh one is taken."""
        if self._gate.down is not None:
            return
        try:
            self._gate.check()          # damage is reported to damaged() by the gate
        except Exception as e:          # noqa: BLE001 -- the writer's tick never fails the writer
            log.debug("disk tier %s: the tick's check: %s", self.path, e)
            return
        if not self._gate.files.replaced():
            return
        log.warning("disk tier %s: the store at its path is another file now (another process replaced it, or its "
                    "filesystem was mounted again); following it", self.path)
        with self._lock:
            try:
                self._swap(self._gate.generation, None)
            except Exception:
                log.exception("disk tier %s: following the replaced store failed", self.path)

    def _swap(self, generation: int, reason: str | None) -> Opened | None:
        """Put a store in place of the one the gate maps (EnvGate.replace), and the index with it.
        `reason`: this process found the store damaged -- it is moved aside (unless another process
        sharing the directory replaced it already: that fresh store is taken as it is) and the
        damaged environment abandoned; None: another process replaced it, which is followed. None
        returned when the store was replaced since `generation`; raises when no store can be had
        (the tier is then down)."""
        got: list[Opened] = []

        def reopen():
            if reason is not None and self._replaced() >= MAX_REPLACEMENTS:
                # NOTE: a disk that keeps damaging fresh stores is off for this process (each
                # damaged environment is abandoned, not closed: this bounds what they hold).
                raise DiskUnavailable(f"{self.path}: {self._replaced()} stores damaged in this process; the disk "
                                      "tier is off until a restart (check the drive)")
            files = self._gate.files
            opened = open_writable(self.path, self._map_size, self._capacity_bytes, reason,
                                   theirs=lambda: files.replaced())
            self._index.replace(opened.hashes)
            got.append(opened)
            return opened.env, opened.dbs
        if not self._gate.replace(generation, reopen, damaged=reason is not None):
            return None
        return got[0]
