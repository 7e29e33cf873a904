"""The remote tier: KV blocks in a shared Valkey/Redis (standalone or cluster), below disk.

Knows: the LowerTier verbs (storage/lower_tier.py) over a store: batched reads (MGETs of up to
32 keys -- in cluster mode of one hash slot --, `connections` of them in flight at once, each
group verified and decoded as it arrives), queued writes (a batch sent as `connections`
pipelines at once), the probe for a chain's blocks, verification of what it reads, the
circuit breaker in front of every call (storage/remote/guarded_calls.py makes each call through
it), and this process's counters.
Doesn't know: the other tiers, the engine, or when a block should be written (storage/
cascade.py decides; storage/remote/writer.py is the thread that writes). Keys and the value frame
are storage/remote/value.py's; building the client is storage/remote/client.py's.

A value is served only after its seal holds under the fleet secret for the key asking
(storage/remote/value.py's open_value: a writer without the secret cannot make one) and
storage/codec/stored_block.verify_and_decode accepts its payload: anything else (forged, damaged,
truncated, another block's bytes under this key) is a miss, deleted and counted in `corrupt`. A
value sealed under another secret is a miss counted in `foreign` and left alone: it is another
fleet's, or a member's started without this fleet's secret file (the log says so once).

Capacity is the store's own: its maxmemory and eviction policy (allkeys-lru is what a cache
wants), and an optional TTL set on every write. A block the store evicted is just a miss.

Failure handling (NOTE invariant: the remote tier never fails or stalls a request): every call
has a bounded socket timeout (`timeout_s`, connect and read) and at most one immediate retry on a
dropped connection (a restarted server's pool holds dead sockets); connection errors and timeouts
are counted (`errors`) and feed the circuit breaker (storage/remote/breaker.py), which, once open,
answers every call at once -- a read misses, a write is dropped (`skipped`) -- until its cooldown
lets a probe through. A store that refuses a write (out of memory, read-only replica) counts a
`write_errors` and is not a breaker failure: it answered.

KV events (storage/kv_events/sink.py, medium "REMOTE"): a block this process wrote is BlockStored once
the store took it; BlockRemoved when this process deletes it (delete(), a damaged value) or a read
finds it gone. The store's own evictions (its LRU, a TTL) are not visible to us and say nothing
until a read misses the block.

Threads: reads run on the loader's threads (never the engine thread); writes on the remote
writer's thread (blocks encoded on its pool, `tieredkv-remote-encode`, a batch ahead of the
sends; with the raw codec, whose encode is a copy, by put on its caller's thread). MGETs, a
batch's pipelines and verify/decode run on this tier's pools (storage/remote/tier_pools.py). A
fetch or send thread writes only its own slot of the call's results, which the calling thread
reads once every one of them ended (client.run_parallel). The client's connection pool is
thread-safe; counters are under `_lock` (held for no I/O), the "known present" set
(storage/remote/known_keys.py) under its own.

Parallel connections (`connections`, DEFAULT_CONNECTIONS unless given): one connection holds a
restore to one reply at a time -- the store idles while the client parses, the client while the
store answers --; with several, the store answers the next MGET while this one is parsed. Every
call is still bounded by the timeout, and a get_many or a write batch is one call for the breaker
(a failed one counts once, however many connections it used).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Sequence

import torch

from storage.cancellation import Cancellation
from storage.remote.breaker import OPEN, BreakerConfig, CircuitBreaker
from storage.codec.payload import Codec
from storage.codec import block_batch
from storage.codec.stored_block import payload_binding
from storage.hashing import BlockKey
from storage.kv_events.sink import NO_EVENTS, REMOTE_MEDIUM, NoEvents
from storage.layout import BlockLayout
from storage.malloc_tuning import keep_freed_memory
from storage.tier_kinds import REMOTE
from storage.lower_tier import LowerTier, owned_or_copied, plain_cpu
from storage.pool_drain import drain_on
from storage.remote.known_keys import KnownKeys
from storage.remote.link_probe import probe_link
from storage.remote.remote_stats import RemoteStats
from storage.remote.tier_pools import RemotePools
from storage.remote.client import mget_groups, mget_one, pipeline, run_parallel, split
from storage.remote.guarded_calls import GuardedCalls
from storage.remote.recv_buffers import RecvBuffers
from storage.remote.url import RemoteURL
from storage.fleet_secret import FleetSecret
from storage.remote.value import FOREIGN, open_value, pack_value, remote_key
from storage.remote.writer import RemoteWriter, WriteItem

log = logging.getLogger(__name__)

# Connections in flight for one get_many or write batch: one per two cores, at most 4. More than
# one pays only with cores to spare beside the store and the decoders: on a 2-core machine that
# also runs the valkey-server, 2 or 4 connections were 0.8-0.99x of one (paired, raw and zstd),
# so there it is one. Measured only there: a larger default elsewhere is a reasoned guess.
DEFAULT_CONNECTIONS = max(1, min(4, (os.cpu_count() or 1) // 2))
_KNOWN_MAX = 1 << 16          # hashes remembered as present in the store (skip re-writing them)


class RemoteTier(LowerTier):
    """Blocks in a Valkey/Redis store. Thread-safe. Nothing connects until the first call.
    LowerTier's defaults hold for it: nothing below it (keep, on_commit), no files to read
    ahead, no listing (iter_blocks), and a queue that drops rather than waits (wait_for_room)."""

    kind = REMOTE
    name = REMOTE.name
    local = REMOTE.local    # what the store holds is asked with probe(), off the engine thread

    def __init__(self, url: RemoteURL, layout: BlockLayout | None, codec: Codec = Codec(), *,
                 secret: FleetSecret, timeout_s: float = 0.5, ttl_s: float | None = None,
                 breaker: BreakerConfig = BreakerConfig(), queue_blocks: int = 256, batch_blocks: int = 32,
                 decode_threads: int | None = None, encode_threads: int | None = None,
                 connections: int = DEFAULT_CONNECTIONS) -> None:
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections: expected an int >= 1, got {connections!r}")
        keep_freed_memory()     # block-sized buffers by the thousand: no page faults each time
        self.url = url
        self.layout = layout
        self.codec = codec
        self.secret = secret          # seals every value written, checks every value read
        self._told_foreign = False    # the one WARNING about values under another secret (under _lock)
        self.timeout_s = timeout_s
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._lock = threading.Lock()
        self.events: NoEvents = NO_EVENTS        # the KV-event hook, set by the cache
        # Keys this process wrote or read, so a block is not sent again (storage/remote/known_keys.py).
        self._known = KnownKeys(float("inf") if ttl_s is None else ttl_s / 2, _KNOWN_MAX)
        self._c = dict.fromkeys(("store_hits", "misses", "errors", "corrupt", "foreign", "skipped", "cancelled",
                                 "cancelled_connections", "writes", "write_errors", "write_drops", "bytes_read",
                                 "bytes_written"), 0)
        # A store back after being down may have restarted empty: forget what we knew it held.
        self.breaker = CircuitBreaker(breaker, on_close=self._known.clear)
        # Every call to the store, through the breaker (storage/remote/guarded_calls.py).
        self._calls = GuardedCalls(url, timeout_s, self.breaker, self._count, self._lock)
        self._call, self._client, self._note_error = self._calls.call, self._calls.client, self._calls.note_error
        self._writer = RemoteWriter(self._write_batch, self._count, queue_blocks, batch_blocks,
                                    encode=self._encode, encode_threads=encode_threads)
        self._writer.start()
        self._decode_threads = decode_threads or os.cpu_count() or 1
        self.connections = connections
        self._pools = RemotePools(connections, self._decode_threads)   # fetch, send, decode: built at first use
        # Where reads receive values (fetch threads take, decode threads give back): warm pages,
        # not a page fault per 4 KiB of every value (storage/remote/recv_buffers.py).
        self._recv = RecvBuffers()

    # ---- reads (loader threads) ------------------------------------------------------------
    def available(self) -> bool:
        """False while the breaker is open: a caller can skip even starting a remote lookup."""
        return self.breaker.state != OPEN

    def exists_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of these blocks the store holds now (one pipelined round trip). An error or an
        open breaker answers False for all: a miss, never an exception."""
        keys = list(keys)
        if not keys:
            return []
        rkeys = [remote_key(k) for k in keys]
        status, got = self._call("exists", lambda c: pipeline(c, [("EXISTS", k) for k in rkeys]))
        if status != "ok":
            return [False] * len(keys)
        answers = [bool(x) and not isinstance(x, Exception) for x in got]
        for rk, x in zip(rkeys, got):
            if x == 0:
                # The store says it does not hold a block this process may believe it wrote (evicted,
                # flushed, lost): forgotten, so the next put() writes it again instead of skipping it.
                self._known.forget(rk)
        return answers

    def probe(self, keys: Sequence[BlockKey]) -> frozenset[bytes]:
        """The hashes of the longest prefix of `keys` (a block chain) the store holds."""
        present = set()
        for key, ok in zip(keys, self.exists_many(keys)):
            if not ok:
                break
            present.add(key.hash)
        return frozenset(present)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None,
                 payloads: list | None = None, cancel: Cancellation | None = None) -> list[torch.Tensor | None]:
        """Verified blocks for `keys` (None: a miss). `outs`, when given, receive the bytes.
        `payloads`, when given (a list as long as `keys`), receives each hit's codec payload
        (verified, bound to hash || namespace): the local disk stores it without encoding again.

        The keys are fetched a group (one MGET) at a time on each of `connections` connections at
        once, and each group's values are verified and decoded on the decode pool as the group
        arrives, while the next groups are on the wire: the network reads and the decompression
        overlap instead of adding up.

        `cancel` (storage/cancellation.py): once cancelled, the MGETs on the wire are cut off (their
        connections shut down and dropped, so the rest of their replies stops crossing the link)
        and no further group is sent; the groups that arrived whole are still served. Counted in
        `cancelled`; no verdict for the breaker (the caller gave up, not the store)."""
        keys = list(keys)
        outs = [None] * len(keys) if outs is None else list(outs)
        if len(outs) != len(keys) or (payloads is not None and len(payloads) != len(keys)):
            raise ValueError(f"outs, payloads: expected {len(keys)} entries")
        results: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return results
        rkeys = [remote_key(k) for k in keys]
        groups = mget_groups(rkeys, self.url.cluster)
        # Slot i: _check's answer for key i, written only by the decode task that took it and read
        # here once every task ended; a key whose group was never fetched keeps None (a miss).
        checked: list[tuple | None] = [None] * len(keys)
        # Slot j: group j's decode tasks (one per decode thread, each taking the group's next value:
        # storage/pool_drain.py), written only by the thread fetching group j.
        tasks: list[list[Future]] = [[] for _ in groups]
        keep = payloads is not None

        def fetch(client, j: int) -> None:
            idx = groups[j]
            values = mget_one(client, [rkeys[i] for i in idx], self._recv.take, cancel)

            def check(t: int) -> None:
                i = idx[t]
                checked[i] = self._check(keys[i], outs[i], values[t], keep)
            tasks[j] = drain_on(self._pools.decoder(), self._decode_threads, range(len(idx)), check)
        # A failure part-way (the store died, a node is down) keeps the groups already fetched.
        status, _ = self._call("get", lambda c: run_parallel(self._pools.fetcher(len(groups)),
                                                             [lambda j=j: fetch(c, j) for j in range(len(groups))]))
        if status == "cancelled":
            self._count(cancelled_connections=cancel.dropped)
        for group_tasks in tasks:
            for task in group_tasks:
                task.result()
        damaged, nbytes, hits, foreign = [], 0, 0, 0
        gone: list[bytes] = []
        for i, answer in enumerate(checked):
            if answer is None:
                continue                            # never fetched: a miss, nothing known of it
            tensor, reason, payload, size = answer
            if tensor is None:
                gone.append(keys[i].hash)
                if reason is None:
                    self._known.forget(rkeys[i])          # absent: evicted, expired, or never written
                    continue
                if reason == FOREIGN:
                    foreign += 1                          # another secret's: a miss, left alone
                    continue
                log.warning("remote tier: block %s is damaged (%s): a miss, deleted", keys[i].hash.hex()[:16], reason)
                damaged.append(rkeys[i])
                continue
            results[i] = tensor
            if payloads is not None:
                payloads[i] = payload
            hits += 1
            nbytes += size
            self._known.remember(rkeys[i])
        self._count(store_hits=hits, misses=len(keys) - hits, corrupt=len(damaged), foreign=foreign, bytes_read=nbytes)
        if foreign:
            self._tell_foreign()
        self.events.removed(gone, REMOTE_MEDIUM)
        if damaged:
            self._call("delete", lambda c: pipeline(c, [("UNLINK", k) for k in damaged]))
        return results

    def _check(self, key: BlockKey, out: torch.Tensor | None, value: object, keep: bool = False
               ) -> tuple[torch.Tensor | None, str | None, memoryview | None, int]:
        """(block, None, payload, value size) for a sound value; (None, reason, None, 0) for a
        forged or damaged one (reason FOREIGN: sealed under another secret); (None, None, None, 0)
        for an absent one. Runs on the decode pool. The value's
        buffer goes back to the receive buffers here -- unless `keep` and it is a hit: then the
        payload returned is a view of it, and its buffer is the caller's from now on."""
        if value is None or isinstance(value, Exception):
            return None, None, None, 0
        handed_over = False
        try:
            opened = open_value(remote_key(key), value, self.secret)
            if opened.problem is not None:
                return None, opened.problem, None, 0
            tensor, reason = block_batch.verify_one(self.codec, self.layout, key, out, opened.payload, opened.meta)
            if tensor is None:
                return None, reason, None, 0
            # NOTE invariant: a buffer whose payload a caller holds is never handed out again.
            handed_over = keep
            return tensor, None, opened.payload if keep else None, len(value)
        finally:
            if not handed_over:         # decode copied the bytes out: never a view of the value
                self._recv.give(value)

    def _tell_foreign(self) -> None:
        with self._lock:
            told, self._told_foreign = self._told_foreign, True
        if not told:
            log.warning("remote tier: the store holds blocks sealed under another fleet secret: misses here, left "
                        "alone. Servers meant to share blocks must share one --cache-secret-file (this one: %s)",
                        self.secret.path or "given in code")

    def get(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.get_many([key], None if out is None else [out])[0]

    def ping(self) -> str | None:
        """None when the store answers now, else why not (one bounded call through the breaker;
        a failure counts like any other). For a server's start-up line, never the request path."""
        status, _ = self._call("ping", lambda c: c.ping())
        if status == "ok":
            return None
        with self._lock:
            return self._calls.last_error if status == "failed" else "breaker open"

    # ---- writes (queued; the remote writer's thread sends them) ----------------------------
    def put(self, key: BlockKey, block: torch.Tensor | None = None, *, wait: bool = False,
            timeout: float | None = None, payload: bytes | None = None, raw_size: int = 0,
            owned: bool = False) -> bool:
        """Queue a block: its bytes (copied now unless `owned`: LowerTier.put, encoded on the writer's pool; with the raw codec
        encoded now instead), or `payload`, already encoded with binding hash || namespace (the
        disk writer's: compressed once for both tiers; `raw_size` its decoded bytes). False when
        it was not queued (queue full; counted in write_drops)."""
        if block is None and payload is None:
            raise ValueError("put: give the block, or its encoded payload")
        if remote_key(key) in self._known:
            return True
        if payload is None and self.codec.kind == "raw" and plain_cpu(block):
            # The raw codec's encode is one copy of the bytes (and an xxh3, ~10x faster than the
            # copy): the stored value, framed here from the codec's parts, IS put's private copy --
            # the block's one copy, where copying now, encoding that copy on the pool and framing
            # it made three (tools/bench_peers.py, remote put). A block it refuses goes the usual
            # way, to fail on the pool and be counted there.
            raw_size, value = block.numel() * block.element_size(), None
            try:
                value = pack_value(key, self.codec.encode_parts(block.detach(), payload_binding(key.hash, key.namespace)),
                                   raw_size, self.secret)
            except Exception:   # noqa: BLE001 -- counted by the writer's encode, as for any block
                pass
            if value is not None:
                return self._writer.submit(WriteItem(key, raw_size=raw_size, value=value), wait, timeout)
        if payload is not None:
            if block is not None:
                raw_size = block.numel() * block.element_size()
            return self._writer.submit(WriteItem(key, payload=payload, raw_size=raw_size), wait, timeout)
        return self._writer.submit(WriteItem(key, block=owned_or_copied(block, owned)), wait, timeout)

    def contains(self, key: BlockKey) -> bool:
        """Whether this process wrote or read the block and still trusts the store to hold it
        (no I/O). Not a lookup: the cache asks the store itself with probe()."""
        return remote_key(key) in self._known

    def delete(self, key: BlockKey) -> bool:
        """UNLINK the block from the store (through the breaker). True when the store had it."""
        rk = remote_key(key)
        self._known.forget(rk)
        status, got = self._call("delete", lambda c: c.unlink(rk))
        if status == "ok" and got:
            self.events.removed([key.hash], REMOTE_MEDIUM)
        return status == "ok" and bool(got)

    def clear(self) -> int:
        """Refused: every server's blocks live in the store; clearing it is the store operator's
        call (FLUSHDB, or its LRU and TTL), not one server's."""
        raise ValueError(f"tier: the {self.name} tier is shared by every server and is not dropped from one")

    def link_probe(self):
        """The link measured (storage/remote/link_probe.py): LinkFigures, or None."""
        return probe_link(self)

    def read_late(self) -> None:
        """A read that outlived its load's deadline: a failure for the breaker (no I/O)."""
        self.breaker.failure()

    def drain(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Wait until every queued write was sent. True when none was lost meanwhile (or since
        `since`, a write_failures() mark)."""
        return self._writer.drain(timeout, since)

    def write_failures(self) -> int:
        """A mark for drain(since=...): taken before queueing writes, a drain then also sees the
        batches that failed before it began waiting."""
        return self._writer.failures()

    def close(self, timeout: float | None = 10.0) -> None:
        """Send what is queued (bounded), stop the writer, close the connections."""
        self._writer.drain(timeout)
        self._writer.stop()
        self._pools.close()
        self._calls.close()

    def _encode(self, it: WriteItem) -> None:
        """The value stored for an item: a raw block's payload (bound to hash || namespace) framed
        from the codec's parts in one join, or a given payload framed; on the writer's encode pool a
        batch ahead of the send, not in the send's path; skipped for a block the store is known to
        hold or one framed at put(). Raises when it cannot encode."""
        if it.value is not None or remote_key(it.key) in self._known:
            return
        if it.payload is None:
            block = it.block.contiguous()
            it.raw_size = block.numel() * block.element_size()
            # The payload's parts framed in one join (not joined into a payload, then copied again).
            it.value = pack_value(it.key, self.codec.encode_parts(block, payload_binding(it.key.hash, it.key.namespace)),
                                  it.raw_size, self.secret)
            it.block = None          # the private copy is no longer needed
        else:
            it.value = pack_value(it.key, it.payload, it.raw_size, self.secret)

    def _write_batch(self, items: list[WriteItem]) -> bool:
        """The writer thread's batch (raw blocks encoded by _encode on the pool): SET every block,
        the batch cut into `connections` pipelines sent at once. True when the store took every
        block."""
        cmds, sent = [], []
        for it in items:
            rk = remote_key(it.key)
            if rk in self._known:
                continue
            if it.value is None:       # skipped by _encode as known, and no longer trusted since
                try:
                    self._encode(it)
                except Exception:
                    log.exception("remote tier: encoding block %s failed", it.key.hash.hex()[:16])
                    self._count(write_errors=1)
                    continue
            value = it.value
            cmds.append(("SET", rk, value) + (("PX", self.ttl_ms) if self.ttl_ms else ()))
            sent.append((it.key, rk, len(value)))
        if not cmds:
            return True
        parts = split(range(len(cmds)), self.connections)
        # Slot j: the replies to part j's SETs, written only by the thread sending part j; None
        # while not sent (or when its pipeline failed: those blocks are lost with it).
        replies: list[list | None] = [None] * len(parts)

        def send(client, j: int) -> None:
            replies[j] = pipeline(client, [cmds[i] for i in parts[j]])
        status, _ = self._call("set", lambda c: run_parallel(self._pools.sender(len(parts)),
                                                             [lambda j=j: send(c, j) for j in range(len(parts))]))
        if status == "skipped":       # not sent (breaker open): a drop
            self._count(write_drops=len(cmds))
            return False
        landed, lost = [], 0
        for part, got in zip(parts, replies):
            if got is None:           # its pipeline failed (the call failed): lost with it
                lost += len(part)
                continue
            for i, r in zip(part, got):
                key, rk, n = sent[i]
                if isinstance(r, Exception):
                    self._count(write_errors=1)
                    self._note_error("set", r)
                    continue
                landed.append(key)
                self._count(writes=1, bytes_written=n)
                self._known.remember(rk)
        self._count(write_errors=lost)
        self.events.stored(landed, REMOTE_MEDIUM)
        return len(landed) == len(sent)

    # ---- bookkeeping -----------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._c[k] += v

    def stats(self) -> RemoteStats:
        with self._lock:
            c, last = dict(self._c), self._calls.last_error
        return RemoteStats(enabled=True, url=self.url.redacted, cluster=self.url.cluster, breaker=self.breaker.state,
                           breaker_opened=self.breaker.opened, pending_writes=self._writer.pending_count(),
                           last_error=last, **c)


