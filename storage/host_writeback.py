"""Write-behind of host slots: blocks the host tier keeps, copied down to the next tier below on a
background thread, with no lock held, so the engine thread never memcpys a written-through block.

Knows: which host blocks are being written down now (under the tiers' lock), its one worker
thread (`tieredkv-host-writeback`, nice +10) and how many jobs are outstanding. A job is
note / copy / check / put: under the tiers' lock each block's slot, the slot's generation
(HostTier.generation) and its pending copy-in are noted; with no lock held the worker waits for
that copy and copies the slot into private memory; under the lock the copy is kept only if the
slot still holds the block with the same generation (else the block left meanwhile: its own
eviction sent it down, and the copy may be torn -- dropped); the kept copy goes to the lower
tier's put (never waiting: a full queue drops it, counted by the tier) with no lock held.
Slots are NOT pinned: a pin would take the slot from `reserve`, and on a small slab the
write-behind would push device victims past the host tier. The block stays in the host tier
throughout: a block written behind is "clean" -- evicting it later copies nothing.
Doesn't know: when a block should go down (storage/cascade.py submits write-through blocks).

Threads: `submit` runs under the tiers' lock (any thread; bookkeeping only); the worker takes
that lock only to check and commit. `wait_idle` waits with no lock held (a flush). `_cv` guards
`_outstanding` only and is never held while taking the tiers' lock.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from storage.hashing import BlockKey
from storage.lower_tier import private_copy
from storage.priority import background_priority
from storage.tiers import Tiers
from storage.transfer import Transfer

log = logging.getLogger(__name__)

_RETAINED_WAIT_S = 30.0   # the most a retained block waits for room in the disk's queue


class HostWriteBack:
    def __init__(self, tiers: Tiers) -> None:
        self.t = tiers
        self._busy: set[bytes] = set()            # hashes queued or being written (tiers' lock)
        self._outstanding = 0                     # jobs submitted, not committed (_cv)
        self._cv = threading.Condition(threading.Lock())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tieredkv-host-writeback",
                                        initializer=background_priority)
        self.written = 0                          # blocks queued below by the worker (tiers' lock)
        self.retained: Callable[[bytes], bool] = lambda h: False   # retained blocks wait for room below

    def submit(self, keys: Iterable[BlockKey]) -> int:
        """Write these host blocks down behind the caller (under the tiers' lock): those still
        in the host tier, not being written already and not held below. Returns blocks taken."""
        t = self.t
        below = t.next_down
        if below is None:
            return 0
        jobs = []
        for key in keys:
            slot = t.host.slot_of(key)
            if slot is None or key.hash in self._busy or below.contains(key):
                continue
            jobs.append((key, slot, t.host.generation(slot), t.transfer.pending(slot)))
            self._busy.add(key.hash)
        if jobs:
            with self._cv:
                self._outstanding += 1
            self._pool.submit(self._run, jobs)
        return len(jobs)

    def busy(self, key: BlockKey) -> bool:
        """Whether this block is being written down now (under the tiers' lock)."""
        return key.hash in self._busy

    def _run(self, jobs: list[tuple[BlockKey, int, int, object | None]]) -> None:
        t = self.t
        below = t.next_down
        try:
            copies = []
            for key, slot, gen, copy_in in jobs:
                Transfer.wait(copy_in)        # NOTE: the copy into the slot is complete before we read it
                copies.append(private_copy(t.host.slab[slot]))
            with t.lock:                      # kept only if the slot still holds the block
                kept = [(key, block) for (key, slot, gen, _), block in zip(jobs, copies)
                        if t.host.slot_of(key) == slot and t.host.generation(slot) == gen]
            # A retained block waits for room in a local tier's queue (this thread's own wait, no
            # lock held): the disk keeps it past its deadline only once it has it.
            queued = [key for key, block in kept
                      if below.put(key, block, wait=below.local and self.retained(key.hash), timeout=_RETAINED_WAIT_S)]
            with t.lock:
                for _ in queued:
                    t.count_write(below.name)
                self.written += len(queued)
        except Exception:
            log.exception("writing %d host blocks down failed: they go down when evicted", len(jobs))
        finally:
            with t.lock:
                for key, *_ in jobs:
                    self._busy.discard(key.hash)
            with self._cv:
                self._outstanding -= 1
                self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Every job submitted so far is committed (no lock held by the caller)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
