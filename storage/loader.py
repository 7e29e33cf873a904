"""The loader: fills device pages from the host, disk and remote tiers off the engine thread.

Knows: the pages being filled right now (hash -> Fill, so two requests needing one block load it
once), the blocks being prefetched from disk into the host tier (hash -> future), the probes
asking the remote store which of a prompt's blocks it holds, and the worker pools that do the
work. Doesn't know: sequences or scheduling -- TieredKVCache.plan()
hands it the fills of one request and the scheduler polls `Load.ready()` between steps. It is
given the tiers (storage/tiers.py: the pool, the host slab, the tiers below, their lock and
counters), never the cache that owns it.

Threads (NOTE: who owns what):
- plan/finish (TieredKVCache) run on the engine thread under the tiers' lock and only allocate,
  acquire, release and register pages: no copy, read or decode.
- a fill runs on a `tieredkv-load` worker. It takes the tiers' lock once for all its host blocks
  (look the slots up, copy them into the pages: memcpys, or on CUDA one batch of copies it
  waits for before letting go, since a slot may be reused once the lock is free) and to finish
  its fills; disk reads and decodes run with no lock held, straight into the pages on CPU, into
  the worker's pinned staging blocks on CUDA (then one batch of copies into the pages).
- remote work runs on `tieredkv-remote` workers, its own pool so a slow store (each call bounded
  by its timeout) never delays a disk fill: a probe (RemoteProbe: which blocks after the last
  local one the store holds, answered before the request is admitted) and the fills of blocks
  planned from the remote, read and verified with no lock held like disk blocks. A restored
  remote block is also written into the local tiers (host, and disk) once registered.
- a prefetch runs on a `tieredkv-prefetch` worker, a chunk of blocks at a time: decoded with no
  lock held, then put into the host tier under the lock. A fill waits for a chunk being read
  and claims the blocks of chunks not started; prefetches never wait on fills (separate pools,
  so a full pool of waiting fills cannot starve the prefetches they wait for).

NOTE invariant: a page being filled holds a reference of its own (the fill's) from its
allocation until the fill ends, and is registered only once its bytes are complete: it is never
evicted, reused or found by another lookup mid-fill, even when every request waiting for it has
gone (its pages released). A fill that fails leaves its page unregistered; the requests that
wait for it cut their prefix there.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from storage.hashing import BlockKey
from storage.pinned import host_buffer
from storage.priority import background_priority
from storage.tiers import Tiers

log = logging.getLogger("tieredkv.loader")

STAGE_BLOCKS = 32       # a load worker's pinned staging blocks for disk fills (a GPU device)
LOAD_WORKERS = 2        # requests whose blocks are read at once (each read decodes in parallel)
PREFETCH_WORKERS = 1    # a prefetch is I/O-bound readahead; one at a time keeps the drive streaming
PREFETCH_CHUNK = 8      # blocks per prefetch task: a fill claims the chunks not started yet
REMOTE_WORKERS = 2      # remote probes and fills at once (network-bound, each bounded by a timeout)


@dataclass(eq=False)
class Fill:
    """One device page being filled with one block. `ok` is meaningful once `done` is set.
    `source` is where the bytes are read; `tier` is where the block is billed from (the disk for
    a block its request's own prefetch moved into the host): set once, when the fill is planned,
    and what every request waiting for it is billed and the promotion is counted by."""
    key: BlockKey
    page: int
    source: str                                   # "host", "disk" or "remote" when planned
    tier: str = ""                                # billed tier; "" means the source
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False

    def __post_init__(self) -> None:
        self.tier = self.tier or self.source


@dataclass(eq=False)
class Load:
    """One request's planned prefix: the pages it holds (prefix order), the tier each block is
    billed from, and the fill each page waits for (None: a device hit, ready now)."""
    pages: list[int]
    tiers: list[str]
    fills: list[Fill | None]
    started: float = field(default_factory=time.perf_counter)

    def ready(self) -> bool:
        return all(f is None or f.done.is_set() for f in self.fills)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self.fills:
            if f is not None and not f.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    @property
    def pending(self) -> bool:
        return any(f is not None for f in self.fills)


@dataclass(eq=False)
class _Chunk:
    """Blocks one prefetch task reads together. `started` (under the tiers' lock): past this
    point a fill waits for `done` instead of claiming the block."""
    keys: list[BlockKey]
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class RemoteProbe:
    """Which blocks of a request's chain (after its last local one) the remote store holds.
    `hashes` is written once by the probing thread, before `done` is set; read only after."""
    hashes: frozenset[bytes] = frozenset()
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Prefetch:
    """A request's disk -> host prefetch. `moved` collects (under the tiers' lock) the hashes this
    prefetch brought into the host tier: the request is billed for them as disk hits. `remote`:
    its remote probe, if one was started (the scheduler admits the request once it is done)."""
    chunks: list[_Chunk] = field(default_factory=list)
    moved: set[bytes] = field(default_factory=set)
    remote: RemoteProbe | None = None

    def wait(self, timeout: float | None = None) -> bool:
        ok = all(c.done.wait(timeout) for c in self.chunks)
        return ok and (self.remote is None or self.remote.done.wait(timeout))

    def remote_pending(self) -> bool:
        return self.remote is not None and not self.remote.done.is_set()

    def remote_hashes(self) -> frozenset[bytes] | None:
        return None if self.remote is None else self.remote.hashes


class Loader:
    def __init__(self, tiers: Tiers) -> None:
        self.t = tiers
        self.inflight: dict[bytes, Fill] = {}          # under the tiers' lock
        self.prefetching: dict[bytes, _Chunk] = {}     # under the tiers' lock
        self._fills = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="tieredkv-load",
                                         initializer=background_priority)
        self._prefetches = ThreadPoolExecutor(PREFETCH_WORKERS, thread_name_prefix="tieredkv-prefetch",
                                              initializer=background_priority)
        self._remote = None if tiers.remote is None else ThreadPoolExecutor(
            REMOTE_WORKERS, thread_name_prefix="tieredkv-remote", initializer=background_priority)
        device = tiers.pool.device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # Disk fills decode into staging blocks and copy from there (a device the CPU cannot
        # write directly); on CPU they decode straight into the pages. Tests set it on CPU to
        # run the staged path's bookkeeping.
        self.stage_decodes = device.type != "cpu"
        self._local = threading.local()         # each load worker's staging blocks
        self._buffers: list = []                # their HostBuffers, released by close()
        self.prefetched_blocks = 0
        self.failed_fills = 0

    # ---- fills ---------------------------------------------------------------------------
    def start(self, fills: list[Fill], after: object = None) -> None:
        """Run these fills (planned under the tiers' lock, their pages held) on a worker: the
        remote ones on the remote pool, the others on the fill pool. `after`: a CUDA event the
        copies into the pages wait for (their old blocks' copies out)."""
        local = [f for f in fills if f.source != "remote"]
        remote = [f for f in fills if f.source == "remote"]
        if local:
            self._fills.submit(self._run_fills, local, after)
        if remote:
            self._remote.submit(self._run_fills, remote, after)

    def probe(self, keys: Sequence[BlockKey], into: RemoteProbe) -> None:
        """Ask the remote store, on a remote worker, which of `keys` (a chain) it holds."""
        self._remote.submit(self._run_probe, list(keys), into)

    def _run_probe(self, keys: list[BlockKey], into: RemoteProbe) -> None:
        try:
            into.hashes = self.t.remote.probe(keys)   # never raises for the store's failures
        except Exception:
            log.exception("probing the remote tier for %d blocks failed: they are misses", len(keys))
        finally:
            into.done.set()

    def _run_fills(self, fills: list[Fill], after: object = None) -> None:
        ok: dict[int, bool] = {}
        try:
            if after is not None:
                self._stream.wait_event(after)    # device-side: the CPU does not wait
            self._wait_for_prefetches(fills)
            for f in self._fill_from_host(fills):
                ok[id(f)] = True
            disk_fills = [f for f in fills if id(f) not in ok and f.source != "remote"]
            remote_fills = [f for f in fills if id(f) not in ok and f.source == "remote"]
            for todo, read in ((disk_fills, self._fill_from_disk), (remote_fills, self._fill_from_remote)):
                if todo:
                    for f, good in zip(todo, read(todo)):
                        ok[id(f)] = good
        except Exception:
            log.exception("loading %d blocks failed: their requests recompute them", len(fills))
        finally:
            self._finish_fills(fills, ok)

    def _wait_for_prefetches(self, fills: list[Fill]) -> None:
        # A block a prefetch is decoding now lands in the host tier: wait for it rather than
        # decoding it twice. A block only queued for prefetch is claimed (the prefetch skips it)
        # and read here, straight into its page: a request admitted at once never waits for a
        # prefetch that has not started. (A prefetch's own failure is a miss, seen below.)
        with self.t.lock:
            started = set()
            for f in fills:
                chunk = self.prefetching.get(f.key.hash)
                if chunk is None:
                    continue
                if chunk.started:
                    started.add(chunk)
                else:
                    del self.prefetching[f.key.hash]
        for chunk in started:
            chunk.done.wait()

    def _fill_from_host(self, fills: list[Fill]) -> list[Fill]:
        """The fills whose block is in the host tier, copied into their pages as one batch.
        NOTE: under the tiers' lock until the copies are complete: a slot may be reused once
        the lock is free (one wait per batch, and host -> device from pinned memory is fast)."""
        c = self.t
        if not c.host.enabled:
            return []
        done, copies = [], []
        started = time.perf_counter()
        with c.lock:
            for f in fills:
                slot = c.host.slot_of(f.key)
                if slot is None:
                    continue
                c.host.touch(f.key)
                c.transfer.wait_host(slot)   # the copy into the slot is complete before we read it
                copies.append((c.pool.kv[f.page], c.host.slab[slot]))
                done.append(f)
            self._copy_many(copies)
        c.rates.observe("host", len(done) * c.layout.nbytes, time.perf_counter() - started)
        return done

    def _fill_from_disk(self, fills: list[Fill]) -> list[bool]:
        return self._fill_from(self.t.disk, fills)

    def _fill_from_remote(self, fills: list[Fill]) -> list[bool]:
        return self._fill_from(self.t.remote, fills, keep=True)

    def _fill_from(self, tier, fills: list[Fill], keep: bool = False) -> list[bool]:
        """Read, verify and decode blocks of the disk or remote tier into the fills' pages, and
        record the tier's restore rate (bytes restored over the wall time)."""
        started = time.perf_counter()
        ok = self._read_into_pages(tier, fills, keep)
        if tier is not None:
            self.t.rates.observe(tier.name, sum(ok) * self.t.layout.nbytes, time.perf_counter() - started)
        return ok

    def _read_into_pages(self, tier, fills: list[Fill], keep: bool = False) -> list[bool]:
        """Read, verify and decode blocks of the disk or remote tier (get_many: a miss is None,
        never an exception for the store's failures) into the fills' pages. `keep` (the remote
        tier): the blocks read also go to the local disk, with their payloads (_keep_on_disk)."""
        c = self.t
        if tier is None:
            return [False] * len(fills)
        kw = {"payloads": [None] * len(fills)} if keep else {}
        if not self.stage_decodes:
            # Decoded straight into the held pages: nothing else reads or writes them (see the
            # module's invariant), so no lock is needed for the bytes.
            got = tier.get_many([f.key for f in fills], [c.pool.kv[f.page] for f in fills], **kw)
            if keep:
                self._keep_on_disk([(f.key, c.pool.kv[f.page], p) for f, b, p in zip(fills, got, kw["payloads"])
                                    if b is not None])
            return [b is not None for b in got]
        # A device the CPU cannot write: decode into this worker's pinned staging blocks, then
        # one batch of truly asynchronous copies into the pages (issue 9, item 4: a decode into
        # fresh pageable memory made each copy a staged, serialised one).
        stage = self._staging()
        ok: list[bool] = []
        for start in range(0, len(fills), STAGE_BLOCKS):
            part = fills[start:start + STAGE_BLOCKS]
            if keep:
                kw["payloads"] = [None] * len(part)
            got = tier.get_many([f.key for f in part], [stage[i] for i in range(len(part))], **kw)
            self._copy_many([(c.pool.kv[f.page], stage[i]) for i, (f, b) in enumerate(zip(part, got)) if b is not None])
            if keep:      # from the staging blocks (CPU), before the next part reuses them
                self._keep_on_disk([(f.key, stage[i], p) for i, (f, b, p) in enumerate(zip(part, got, kw["payloads"]))
                                    if b is not None])
            ok += [b is not None for b in got]
        return ok

    def _staging(self) -> torch.Tensor:
        """This worker's staging blocks [STAGE_BLOCKS, *layout.shape] (pinned on CUDA)."""
        stage = getattr(self._local, "stage", None)
        if stage is None:
            layout = self.t.layout
            buf = host_buffer(STAGE_BLOCKS * layout.nbytes, pin=self._stream is not None)
            self._buffers.append(buf)
            stage = self._local.stage = buf.tensor.view(layout.dtype).view(STAGE_BLOCKS, *layout.shape)
        return stage

    def _copy_many(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst <- src for each pair, complete when this returns (a fill is done only when its
        bytes are, and the sources are reused next)."""
        if self._stream is None:
            for dst, src in copies:
                dst.copy_(src)
            return
        if not copies:
            return
        with torch.cuda.stream(self._stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()        # these copies only (a stream sync would also wait for later work)

    def _finish_fills(self, fills: list[Fill], ok: dict[int, bool]) -> None:
        c = self.t
        with c.lock:
            for f in fills:
                f.ok = ok.get(id(f), False)
                if f.ok:
                    # Registered before the fill's own reference goes: if every request waiting
                    # for it is gone, the page becomes a cached block, not a free page.
                    c.pool.register(f.page, f.key)
                    c.count_promotion(f.tier)     # counted once, by the tier it is billed from
                else:
                    self.failed_fills += 1
                if self.inflight.get(f.key.hash) is f:
                    del self.inflight[f.key.hash]
                c.pool.release(f.page)
                f.done.set()

    def _keep_on_disk(self, kept: list[tuple[BlockKey, torch.Tensor, bytes]]) -> None:
        """Blocks just read from the remote (key, their bytes on the CPU, the payload the store
        gave) also go to the local disk, so the next miss of this process -- after a restart too --
        stays local. The payload is stored as it is: the block is not compressed a second time
        (on a CPU-bound server that would compete with the forward the restore is for). Never
        waits: a full disk queue drops it, as in the eviction cascade. No lock is held for the
        copy (the caller's fills own these bytes); the host tier gets them as any device block,
        when they fall out of the device pool."""
        c = self.t
        if c.disk is None:
            return
        try:
            queued = sum(1 for key, block, payload in kept
                         if not c.disk.contains(key) and c.disk.put(key, block, wait=False, payload=payload))
        except Exception:     # keeping a copy is a nicety: the fills themselves succeeded
            log.exception("keeping %d remote blocks on disk failed", len(kept))
            return
        if queued:
            with c.lock:
                for _ in range(queued):
                    c.count_write("disk")

    # ---- prefetch ------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[BlockKey], into: Prefetch) -> None:
        """Read these disk blocks into the host tier in the background, PREFETCH_CHUNK at a time
        (called under the tiers' lock, with the blocks on disk, not in flight, not prefetched)."""
        for i in range(0, len(keys), PREFETCH_CHUNK):
            chunk = _Chunk(list(keys[i:i + PREFETCH_CHUNK]))
            for k in chunk.keys:
                self.prefetching[k.hash] = chunk
            into.chunks.append(chunk)
            self._prefetches.submit(self._run_prefetch, chunk, into)

    def _run_prefetch(self, chunk: "_Chunk", into: Prefetch) -> None:
        c = self.t
        keys: list[BlockKey] = []
        try:
            with c.lock:
                # Only what is still this chunk's: a fill may have claimed a block meanwhile.
                keys = [k for k in chunk.keys if self.prefetching.get(k.hash) is chunk]
                chunk.started = True
            if not keys:
                return
            if not c.host.enabled:
                c.disk.read_ahead(keys)    # no host tier to hold them: warm the OS page cache
                return
            blocks = c.disk.get_many(keys)
            with c.lock:
                for key, block in zip(keys, blocks):
                    if block is None or c.pool.page_of(key) is not None or c.host.slot_of(key) is not None:
                        continue
                    slot = c.host.reserve(key)
                    c.transfer.wait_host(slot)     # a dropped block's late copy must not land on ours
                    c.host.slab[slot].copy_(block.view(c.layout.shape))
                    into.moved.add(key.hash)
                    self.prefetched_blocks += 1
        except Exception:
            log.exception("prefetching %d disk blocks failed: their requests read them later", len(keys))
        finally:
            with c.lock:
                for k in keys:
                    if self.prefetching.get(k.hash) is chunk:
                        del self.prefetching[k.hash]
            chunk.done.set()

    def close(self) -> None:
        self._prefetches.shutdown(wait=True)
        self._fills.shutdown(wait=True)
        if self._remote is not None:
            self._remote.shutdown(wait=True)
        for buf in self._buffers:      # every copy out of them completed inside _copy_many
            buf.close()
        self._buffers.clear()
