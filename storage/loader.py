"""The loader: fills device pages from the host tier and the tiers below it off the engine thread.

Knows: the pages being filled right now (hash -> Fill, so two requests needing one block load it
once), the probes asking the tiers over a link which of a prompt's blocks they hold, and the worker
pools that do the work; the disk -> host prefetch is its `prefetcher` (storage/prefetch.py).
Doesn't know: sequences or scheduling -- TieredKVCache.start_load() hands it the fills of one request
and the scheduler polls `Load.ready()` between steps. It is given the tiers (storage/tiers.py:
the pool, the host slab, the tiers below, their lock and counters), never the cache that owns
it, and names no tier below the host: a fill reads from its source tier, a tier over a link (not
`local`) on the linked workers, and what is read from a tier is offered to the tier above it
(LowerTier.keep: the store's blocks kept on disk).

Threads (NOTE: who owns what):
- plan/finish (TieredKVCache) run on the engine thread under the tiers' lock and only allocate,
  acquire, release and register pages: no copy, read or decode.
- a fill runs on a `tieredkv-load` worker. It holds the tiers' lock only for bookkeeping: once
  to look its host blocks' slots up and pin them (HostTier.pin: a pinned slot is never evicted,
  freed or reserved, so its bytes stay put) and take each slot's pending copy in, once to unpin
  them, and once to finish its fills. Between those, with no lock held, it waits for the copies
  into the slots (on CUDA its copy stream waits for them, not the CPU) and copies the slots into
  the pages (memcpys, or on CUDA one batch of copies it waits for). Disk reads and decodes run
  with no lock held, straight into the pages on CPU; on CUDA into the worker's two pinned
  staging halves, double-buffered: part k+1 is read and decoded into one half while part k's
  copies out of the other run on the worker's stream, and a half is rewritten only once the
  copies out of it are complete.
- the tiers over a link (the store) have their own pool (threads `tieredkv-remote`), so a slow
  store (each call bounded by its timeout) never delays a disk fill: a probe (ChainProbe: which
  blocks after the last local one each linked tier holds, answered before the request is
  admitted) and the fills of blocks planned from a linked tier, read and verified with no lock
  held like disk blocks. A block restored from a linked tier is also kept by the tier above it
  (the disk: LowerTier.keep, its payload as read), and reaches the host as any device block does.
- a prefetch runs on the `tieredkv-prefetch` worker (storage/prefetch.py); a fill first waits
  for a chunk of its blocks being read and claims those of chunks not started.

KV events (storage/kv_events/sink.py) are the tiers' own: a fill's pages are registered together
(DevicePool.register_many: one BlockStored GPU).

NOTE invariant: a page being filled holds a reference of its own (the fill's) from its
allocation until the fill ends, and is registered only once its bytes are complete: it is never
evicted, reused or found by another lookup mid-fill, even when every request waiting for it has
gone (its pages released). A fill that fails leaves its page unregistered; the requests that
wait for it cut their prefix there.

Cancelling (issue 27): the linked fills one plan started are one task with a Cancellation
(storage/cancellation.py). Each fill counts the loads waiting for it (`Fill.waiters`, under the
tiers' lock: plan adds one per load, `stop_waiting` takes it back when the load is finished,
abandoned or cancelled). When no load waits for any unfinished fill of a task, the task is given
up: its MGETs on the wire are cut off, so a slow link stops carrying bytes nobody waits for
(they would delay the next request's probe), and no new load shares its fills. What arrived
whole before the cut still lands and is registered, as any late fill's block.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from storage.cancellation import Cancellation
from storage.hashing import BlockKey
from storage.load_records import ChainProbe, Fill, ProbeAnswer, _Task
from storage.lower_tier import LowerTier
from storage.pinned import host_buffer
from storage.prefetch import Prefetcher
from storage.priority import background_priority
from storage.tiers import Tiers
from storage.transfer import Transfer

log = logging.getLogger("tieredkv.loader")

# A staged fill (a GPU device) reads a part of STAGE_BLOCKS blocks into one of a load worker's
# two pinned staging halves while the other half's copies into the pages run. Not the remote
# tier's MGET chunk (storage/remote/client.py, 32): a part of two MGETs lets the store's network
# read of the second overlap the decode of the first inside one get_many. STAGE_BYTES caps both
# halves together for models with large blocks (a part never has fewer than one block).
STAGE_BLOCKS = 64
STAGE_BYTES = 256 << 20
LOAD_WORKERS = 2        # requests whose blocks are read at once (each read decodes in parallel)
LINKED_WORKERS = 2      # linked tiers' probes and fills at once (network-bound, each bounded by a timeout)


class Loader:
    def __init__(self, tiers: Tiers) -> None:
        self.t = tiers
        self.inflight: dict[bytes, Fill] = {}          # under the tiers' lock
        self.prefetcher = Prefetcher(tiers)             # disk -> host, on its own worker
        self.prefetching = self.prefetcher.chunks       # hash -> its prefetch chunk (under the lock)
        self._fills = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="tieredkv-load",
                                         initializer=background_priority)
        # The tiers over a link have workers of their own (a slow store never delays a disk fill).
        self._linked = None if not tiers.linked else ThreadPoolExecutor(
            LINKED_WORKERS, thread_name_prefix="tieredkv-remote", initializer=background_priority)
        device = tiers.pool.device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # Disk fills decode into staging blocks and copy from there (a device the CPU cannot
        # write directly); on CPU they decode straight into the pages. Tests set it on CPU to
        # run the staged path's bookkeeping.
        self.stage_decodes = device.type != "cpu" or tiers.pool.by_layer     # a layer-major page is strided
        self._local = threading.local()         # each load worker's staging halves
        self._buffers: list = []                # their HostBuffers, released by close()
        # Tests (CPU) call defer_copies(): the fills' copies into pages then complete later, on a
        # thread, as on CUDA, so a missing wait before a source is reused shows as wrong bytes.
        self._late: ThreadPoolExecutor | None = None
        self.failed_fills = 0

    # ---- fills ---------------------------------------------------------------------------
    def start(self, fills: list[Fill], after: object = None) -> None:
        """Run these fills (planned under the tiers' lock, their pages held) on a worker: those
        read from a tier over a link on its pool, the others on the fill pool. `after`: a CUDA
        event the copies into the pages wait for (their old blocks' copies out)."""
        linked = {below.name for below in self.t.linked}
        local = [f for f in fills if f.read_from not in linked]
        over_link = [f for f in fills if f.read_from in linked]
        if local:
            self._fills.submit(self._run_fills, local, after)
        if over_link:
            task = _Task(over_link)
            for f in over_link:
                f.task = task
            self._linked.submit(self._run_fills, over_link, after, task.cancel)

    def wait_for(self, fill: Fill) -> None:
        """A load waits for `fill` (under the tiers' lock; TieredKVCache.start_load)."""
        fill.waiters += 1

    def stop_waiting(self, fills: Sequence[Fill | None]) -> list[Cancellation]:
        """A load stops waiting for its fills (under the tiers' lock: finished, abandoned at its
        deadline, or cancelled). Returns the reads no load waits for any more, given up now: the
        caller cancels each once it let the lock go (a socket shutdown, never a wait). Each is
        counted in its tier's `reads_cancelled`."""
        tasks = []
        for f in fills:
            if f is None:
                continue
            f.waiters -= 1
            if f.task is not None and not f.task.given_up and not f.done.is_set() and f.task not in tasks:
                tasks.append(f.task)
        out = []
        for task in tasks:
            if all(f.waiters <= 0 or f.done.is_set() for f in task.fills):
                task.given_up = True
                self.t.counters[task.fills[0].read_from].reads_cancelled += 1
                out.append(task.cancel)
        return out

    def probe(self, tiers: Sequence[LowerTier], keys: Sequence[BlockKey], into: ChainProbe) -> None:
        """Ask these tiers over a link, on a linked worker, which of `keys` (a chain) they hold."""
        self._linked.submit(self._run_probe, tuple(tiers), list(keys), into)

    def _run_probe(self, tiers: tuple[LowerTier, ...], keys: list[BlockKey], into: ChainProbe) -> None:
        try:
            # Each tier's answer kept as its own: a block only the second holds is read from it.
            into.answer = ProbeAnswer({below.name: below.probe(keys) for below in tiers})   # never raises
        except Exception:
            log.exception("probing the tiers below for %d blocks failed: they are misses", len(keys))
        finally:
            into.done.set()

    def _run_fills(self, fills: list[Fill], after: object = None, cancel: Cancellation | None = None) -> None:
        ok: dict[int, bool] = {}
        try:
            if after is not None:
                self._stream.wait_event(after)    # device-side: the CPU does not wait
            self.prefetcher.wait_or_claim([f.key for f in fills])
            for f in self._fill_from_host(fills):
                ok[id(f)] = True
            # The rest from their tiers below, in order. A block planned from the host whose slot
            # went meanwhile is read from the first tier below when that is this process's own
            # (where the host's evictions go); else it fails, as a block gone from every tier.
            first = self.t.next_down
            fallback = first if first is not None and first.local else None
            for below in self.t.lower:
                todo = [f for f in fills if id(f) not in ok
                        and (self.t.below(f.read_from) or fallback) is below]
                if todo:
                    for f, good in zip(todo, self._fill_from(below, todo, cancel)):
                        ok[id(f)] = good
        except Exception:
            log.exception("loading %d blocks failed: their requests recompute them", len(fills))
        finally:
            self._finish_fills(fills, ok)

    def _fill_from_host(self, fills: list[Fill]) -> list[Fill]:
        """The fills whose block is in the host tier, copied into their pages as one batch.
        NOTE: the tiers' lock is held only to pin the slots and take their pending copies in
        (then to unpin them), never across a wait or a copy: a pinned slot is not evicted or
        reused (storage/host_tier.py enforces it), and a copy into it that is still running is
        waited for with the lock free (Transfer.pending / wait)."""
        c = self.t
        if not c.host.enabled:
            return []
        done, slots, copies, copies_in = [], [], [], []
        started = time.perf_counter()
        with c.lock:
            for f in fills:
                slot = c.host.slot_of(f.key)
                if slot is None:
                    continue
                c.host.touch(f.key)
                c.host.pin(slot)
                copies_in.append(c.transfer.pending(slot))
                copies.append((c.pool.kv[f.page], c.host.slab[slot]))
                slots.append(slot)
                done.append(f)
        device_s = None
        try:
            for copy_in in copies_in:     # the copy into the slot is complete before we read it
                c.transfer.wait(copy_in, self._stream)
            device_s = self._copy_many(copies)
        finally:
            with c.lock:                  # the copies out are complete (or failed): the slots may go
                for slot in slots:
                    c.host.unpin(slot)
        # On CUDA the copies' own time (not the stream's wait for the forward in flight).
        c.rates.observe("host", len(done) * c.layout.nbytes,
                        device_s if device_s is not None else time.perf_counter() - started)
        return done

    def _fill_from(self, tier: LowerTier, fills: list[Fill], cancel: Cancellation | None = None) -> list[bool]:
        """Read, verify and decode blocks of a tier below into the fills' pages, and record the
        tier's restore rate (bytes restored over the wall time)."""
        started = time.perf_counter()
        ok = self._read_into_pages(tier, fills, self.t.above(tier), cancel)
        self.t.rates.observe(tier.name, sum(ok) * self.t.layout.nbytes, time.perf_counter() - started)
        return ok

    def _read_into_pages(self, tier: LowerTier, fills: list[Fill], keeper: LowerTier | None = None,
                         cancel: Cancellation | None = None) -> list[bool]:
        """Read, verify and decode blocks of a tier below (get_many: a miss is None, never an
        exception for the store's failures) into the fills' pages. `keeper` (the tier above it:
        the disk above the store): the blocks read also go there, with their payloads (_keep).
        `cancel`: the read stops once it is cancelled (what arrived whole still lands)."""
        c = self.t
        keep = keeper is not None
        kw = {"payloads": [None] * len(fills)} if keep else {}
        if cancel is not None:
            kw["cancel"] = cancel
        if not self.stage_decodes:
            # Decoded straight into the held pages: nothing else reads or writes them (see the
            # module's invariant), so no lock is needed for the bytes.
            got = tier.get_many([f.key for f in fills], [c.pool.kv[f.page] for f in fills], **kw)
            if keep:
                self._keep(keeper, [(f.key, c.pool.kv[f.page], p) for f, b, p in zip(fills, got, kw["payloads"])
                                    if b is not None])
            return [b is not None for b in got]
        # A device the CPU cannot write: decode into this worker's pinned staging halves, then
        # truly asynchronous copies into the pages (issue 9, item 4: a decode into fresh
        # pageable memory made each copy a staged, serialised one). Double-buffered (issue 18):
        # part k's copies run while part k+1 is read and decoded into the other half.
        stage = self._staging()
        part = stage.shape[1]
        copying: list[object | None] = [None, None]     # each half's copies out, not waited for yet
        ok: list[bool] = []
        try:
            for n, start in enumerate(range(0, len(fills), part)):
                half, chunk = stage[n % 2], fills[start:start + part]
                # NOTE invariant: a half is rewritten only once every copy out of it is complete.
                self._wait_copies(copying[n % 2])
                copying[n % 2] = None
                if keep:
                    kw["payloads"] = [None] * len(chunk)
                if cancel is not None and cancel.cancelled:
                    ok += [False] * len(chunk)     # given up: the parts not read are misses
                    continue
                got = tier.get_many([f.key for f in chunk], [half[i] for i in range(len(chunk))], **kw)
                copying[n % 2] = self._copy_async([(c.pool.kv[f.page], half[i])
                                                   for i, (f, b) in enumerate(zip(chunk, got)) if b is not None])
                if keep:      # reads the half (CPU) beside the copies, before it is rewritten
                    self._keep(keeper, [(f.key, half[i], p) for i, (f, b, p) in enumerate(zip(chunk, got, kw["payloads"]))
                                        if b is not None])
                ok += [b is not None for b in got]
        finally:
            # A fill is done only when its bytes are, and the next call rewrites the halves.
            for done in copying:
                self._wait_copies(done)
        return ok

    def _staging(self) -> torch.Tensor:
        """This worker's two staging halves [2, part, *layout.shape] (pinned on CUDA): a part is
        STAGE_BLOCKS blocks, fewer when two halves would pass STAGE_BYTES."""
        stage = getattr(self._local, "stage", None)
        if stage is None:
            layout = self.t.layout
            part = max(1, min(STAGE_BLOCKS, STAGE_BYTES // (2 * layout.nbytes)))
            buf = host_buffer(2 * part * layout.nbytes, pin=self._stream is not None, device=self.t.pool.device)
            self._buffers.append(buf)
            stage = self._local.stage = buf.tensor.view(layout.dtype).view(2, part, *layout.shape)
        return stage

    def defer_copies(self) -> None:
        """Tests (CPU): copies into pages complete later, on a thread (see `_late`)."""
        if self._stream is None and self._late is None:
            self._late = ThreadPoolExecutor(1, thread_name_prefix="tieredkv-late-fill")

    def _copy_async(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> object | None:
        """Issue dst <- src for each pair; returns their completion for `_wait_copies` (a CUDA
        event, a Future in the deferred CPU mode, None when already complete: CPU memcpys).
        NOTE: the sources must not be rewritten, nor the fills finished, before it is waited."""
        if not copies:
            return None
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)     # timed: _copy_many reads it
                done.record(self._stream)
            return done
        if self._late is not None:
            return self._late.submit(_late_copy, copies)
        for dst, src in copies:
            dst.copy_(src)
        return None

    @staticmethod
    def _wait_copies(done: object | None) -> None:
        """The CPU waits for these copies only (a stream sync would also wait for later work)."""
        Transfer.wait(done)

    def _copy_many(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """dst <- src for each pair, complete when this returns (a fill is done only when its
        bytes are, and the sources are reused next). On CUDA: the copies' device time, from
        timing events on the fill's stream read after the wait (else None)."""
        start = None
        if self._stream is not None and copies:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._stream)      # passed once the stream's earlier waits are
        done = self._copy_async(copies)
        self._wait_copies(done)
        return None if start is None else start.elapsed_time(done) / 1000.0

    def _finish_fills(self, fills: list[Fill], ok: dict[int, bool]) -> None:
        c = self.t
        with c.lock:
            for f in fills:
                f.ok = ok.get(id(f), False)
            # Registered (one BlockStored GPU, said by the pool) before the fills' own references
            # go: if every request waiting for one is gone, its page becomes a cached block.
            c.pool.register_many([(f.page, f.key) for f in fills if f.ok])
            for f in fills:
                if f.ok:
                    c.count_promotion(f.billed_tier)     # counted once, by the tier it is billed from
                else:
                    self.failed_fills += 1
                if self.inflight.get(f.key.hash) is f:
                    del self.inflight[f.key.hash]
                c.pool.release(f.page)
                f.done.set()

    def _keep(self, keeper: LowerTier, kept: list[tuple[BlockKey, torch.Tensor, bytes]]) -> None:
        """Blocks just read from a tier below (key, their bytes on the CPU, the payload it gave)
        also go to `keeper`, the tier above it (the store's blocks onto the local disk), so the
        next miss of this process -- after a restart too -- stays local. The payload is stored as
        it is: the block is not compressed a second time (on a CPU-bound server that would compete
        with the forward the restore is for). Never waits: a full queue drops it, as in the
        eviction cascade. No lock is held for the copy (the caller's fills own these bytes); the
        host tier gets them as any device block, when they fall out of the device pool."""
        c = self.t
        try:
            queued = keeper.keep(kept)
        except Exception:     # keeping a copy is a nicety: the fills themselves succeeded
            log.exception("keeping %d blocks read from below on %s failed", len(kept), keeper.name)
            return
        if queued:
            with c.lock:
                for _ in range(queued):
                    c.count_write(keeper.name)

    def close(self, release_memory: bool = True) -> None:
        """Stop the workers; `release_memory=False` leaves the staging halves pinned and mapped."""
        self.prefetcher.close()
        self._fills.shutdown(wait=True)
        if self._linked is not None:
            self._linked.shutdown(wait=True)
        if self._late is not None:
            self._late.shutdown(wait=True)
        if release_memory:
            for buf in self._buffers:      # every copy out of them was waited for by its fill
                buf.close()
            self._buffers.clear()


def _late_copy(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A deferred copy (tests, CPU): reads its sources when it runs, as a queued device copy
    would, so a source rewritten before the wait shows as wrong bytes in the page."""
    time.sleep(random.uniform(0.0005, 0.003))
    for dst, src in copies:
        dst.copy_(src)
