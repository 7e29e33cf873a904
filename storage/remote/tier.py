"""The remote tier: KV blocks in a shared Valkey/Redis (standalone or cluster), below disk.

Knows: the LowerTier verbs (storage/lower_tier.py) over a store: batched reads (an MGET of up to
32 keys at a time -- in cluster mode of one hash slot --, each group decoded while the next is
fetched), queued writes, the probe for a chain's blocks, verification of what it reads, the
circuit breaker in front of every call, and this process's counters.
Doesn't know: the other tiers, the engine, or when a block should be written (storage/
cascade.py decides; storage/remote/writer.py is the thread that writes). Keys and the value frame
are storage/remote/value.py's; building the client is storage/remote/client.py's.

A value is served only after storage/codec/stored_block.verify_and_decode accepts it for the key
asking: anything else (damaged, truncated, another block's bytes under this key) is a miss,
deleted and counted in `corrupt`.

Capacity is the store's own: its maxmemory and eviction policy (allkeys-lru is what a cache
wants), and an optional TTL set on every write. A block the store evicted is just a miss.

Failure handling (NOTE invariant: the remote tier never fails or stalls a request): every call
has a bounded socket timeout (`timeout_s`, connect and read) and at most one immediate retry on a
dropped connection (a restarted server's pool holds dead sockets); connection errors and timeouts
are counted (`errors`) and feed the circuit breaker (storage/remote/breaker.py), which, once open,
answers every call at once -- a read misses, a write is dropped (`skipped`) -- until its cooldown
lets a probe through. A store that refuses a write (out of memory, read-only replica) counts a
`write_errors` and is not a breaker failure: it answered.

KV events (storage/kv_events/sink.py, medium REMOTE): a block this process wrote is BlockStored once
the store took it; BlockRemoved when this process deletes it (delete(), a damaged value) or a read
finds it gone. The store's own evictions (its LRU, a TTL) are not visible to us and say nothing
until a read misses the block.

Threads: reads run on the loader's threads (never the engine thread), their verification and
decoding on this tier's decode pool (`tieredkv-remote-decode`), writes on the remote writer's
thread (raw blocks encoded on its pool, `tieredkv-remote-encode`, a batch ahead of the sends);
the client's connection pool is thread-safe; counters and the small "known present" set are
under `_lock` (held for no I/O).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from storage.remote.breaker import OPEN, BreakerConfig, CircuitBreaker
from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding, verify_and_decode
from storage.hashing import BlockKey
from storage.kv_events.sink import NO_EVENTS, REMOTE, NoEvents
from storage.layout import BlockLayout
from storage.lower_tier import private_copy
from storage.priority import background_priority
from storage.remote.client import is_unavailable, make_client, mget_groups, mget_one, pipeline
from storage.remote.url import RemoteURL
from storage.remote.value import pack_value, remote_key, unpack_value
from storage.remote.writer import RemoteWriter, WriteItem

log = logging.getLogger(__name__)

_KNOWN_MAX = 1 << 16          # hashes remembered as present in the store (skip re-writing them)
_LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class RemoteStats:
    enabled: bool
    url: str                   # password redacted
    cluster: bool
    breaker: str               # closed | open | half_open
    breaker_opened: int        # times the breaker opened
    hits: int                  # blocks read and verified
    misses: int                # blocks asked for and not served (absent, damaged, or an error)
    errors: int                # calls that failed (connection, timeout): breaker failures
    corrupt: int               # values that failed verification (deleted)
    skipped: int               # calls not made because the breaker was open
    writes: int                # blocks written
    write_errors: int          # blocks the store refused (e.g. out of memory) or a failed batch lost
    write_drops: int           # blocks never sent: queue full, or breaker open
    bytes_read: int
    bytes_written: int
    pending_writes: int
    last_error: str | None


class RemoteTier:
    """Blocks in a Valkey/Redis store. Thread-safe. Nothing connects until the first call."""

    name = "remote"
    local = False    # what the store holds is asked with probe(), off the engine thread

    def __init__(self, url: RemoteURL, layout: BlockLayout | None, codec: Codec = Codec(), *,
                 timeout_s: float = 0.5, ttl_s: float | None = None,
                 breaker: BreakerConfig = BreakerConfig(), queue_blocks: int = 256, batch_blocks: int = 32,
                 decode_threads: int | None = None, encode_threads: int | None = None) -> None:
        self.url = url
        self.layout = layout
        self.codec = codec
        self.timeout_s = timeout_s
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._lock = threading.Lock()
        self.events: NoEvents = NO_EVENTS        # the KV-event hook, set by the cache
        self._client_obj = None
        self._client_lock = threading.Lock()     # building the client (RedisCluster connects)
        # Keys this process wrote or read, so a block is not sent again (a restored block reaches
        # the local disk, whose commit would forward it back). key -> until when it is trusted:
        # half the TTL (the store forgets it by then), else until a read misses it or the breaker
        # reopens (the store may have restarted empty).
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._known_s = float("inf") if ttl_s is None else ttl_s / 2
        self._c = dict.fromkeys(("hits", "misses", "errors", "corrupt", "skipped", "writes", "write_errors",
                                 "write_drops", "bytes_read", "bytes_written"), 0)
        self._last_error: str | None = None
        self._last_log = -1e9
        # A store back after being down may have restarted empty: forget what we knew it held.
        self.breaker = CircuitBreaker(breaker, on_close=self._forget_known)
        self._writer = RemoteWriter(self._write_batch, self._count, queue_blocks, batch_blocks,
                                    encode=self._encode, encode_threads=encode_threads)
        self._writer.start()
        self._decode_threads = decode_threads or os.cpu_count() or 1
        self._decode_pool: ThreadPoolExecutor | None = None     # built at the first read

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
        return [bool(x) and not isinstance(x, Exception) for x in got]

    def probe(self, keys: Sequence[BlockKey]) -> frozenset[bytes]:
        """The hashes of the longest prefix of `keys` (a block chain) the store holds."""
        present = set()
        for key, ok in zip(keys, self.exists_many(keys)):
            if not ok:
                break
            present.add(key.hash)
        return frozenset(present)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None] | None = None,
                 payloads: list | None = None) -> list[torch.Tensor | None]:
        """Verified blocks for `keys` (None: a miss). `outs`, when given, receive the bytes.
        `payloads`, when given (a list as long as `keys`), receives each hit's codec payload
        (verified, bound to hash || namespace): the local disk stores it without encoding again.

        The keys are fetched a group (one MGET) at a time, and each group's values are verified
        and decoded on the decode pool while the next group is on the wire: the network read
        and the decompression overlap instead of adding up."""
        keys = list(keys)
        outs = [None] * len(keys) if outs is None else list(outs)
        if len(outs) != len(keys) or (payloads is not None and len(payloads) != len(keys)):
            raise ValueError(f"outs, payloads: expected {len(keys)} entries")
        results: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return results
        rkeys = [remote_key(k) for k in keys]
        fetched: list[tuple[int, Future]] = []          # (index, its check), in fetch order

        def fetch(client) -> None:
            for group in mget_groups(rkeys, self.url.cluster):
                values = mget_one(client, [rkeys[i] for i in group])
                decoder = self._decoder()
                fetched.extend((i, decoder.submit(self._check, keys[i], outs[i], v)) for i, v in zip(group, values))
        # A failure part-way (the store died, a node is down) keeps the groups already fetched.
        self._call("get", fetch)
        damaged, nbytes, hits = [], 0, 0
        gone: list[bytes] = []
        for i, future in fetched:
            tensor, reason, payload, size = future.result()
            if tensor is None:
                gone.append(keys[i].hash)
                if reason is None:
                    self._forget(rkeys[i])          # absent: evicted, expired, or never written
                    continue
                log.warning("remote tier: block %s is damaged (%s): a miss, deleted", keys[i].hash.hex()[:16], reason)
                damaged.append(rkeys[i])
                continue
            results[i] = tensor
            if payloads is not None:
                payloads[i] = payload
            hits += 1
            nbytes += size
            self._remember(rkeys[i])
        self._count(hits=hits, misses=len(keys) - hits, corrupt=len(damaged), bytes_read=nbytes)
        self.events.removed(gone, REMOTE)
        if damaged:
            self._call("delete", lambda c: pipeline(c, [("UNLINK", k) for k in damaged]))
        return results

    def _check(self, key: BlockKey, out: torch.Tensor | None, value: object
               ) -> tuple[torch.Tensor | None, str | None, bytes | None, int]:
        """(block, None, payload, value size) for a sound value; (None, reason, None, 0) for a
        damaged one; (None, None, None, 0) for an absent one. Runs on the decode pool."""
        if value is None or isinstance(value, Exception):
            return None, None, None, 0
        meta, payload = unpack_value(value)
        if meta is None:
            return None, "value framing damaged", None, 0
        tensor, reason = verify_and_decode(self.codec, self.layout, key, out, payload, meta)
        if tensor is None:
            return None, reason, None, 0
        return tensor, None, payload, len(value)

    def get(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.get_many([key], None if out is None else [out])[0]

    def ping(self) -> str | None:
        """None when the store answers now, else why not (one bounded call through the breaker;
        a failure counts like any other). For a server's start-up line, never the request path."""
        status, _ = self._call("ping", lambda c: c.ping())
        if status == "ok":
            return None
        with self._lock:
            return self._last_error if status == "failed" else "breaker open"

    # ---- writes (queued; the remote writer's thread sends them) ----------------------------
    def put(self, key: BlockKey, block: torch.Tensor | None = None, *, wait: bool = False,
            timeout: float | None = None, payload: bytes | None = None, raw_size: int = 0) -> bool:
        """Queue a block: its bytes (copied now, encoded on the writer's pool), or `payload`,
        already encoded with binding hash || namespace (the disk writer's: compressed once for
        both tiers; `raw_size` its decoded bytes). False when it was not queued (queue full;
        counted in write_drops)."""
        if block is None and payload is None:
            raise ValueError("put: give the block, or its encoded payload")
        if self._is_known(remote_key(key)):
            return True
        if payload is not None:
            if block is not None:
                raw_size = block.numel() * block.element_size()
            return self._writer.submit(WriteItem(key, payload=payload, raw_size=raw_size), wait, timeout)
        return self._writer.submit(WriteItem(key, block=private_copy(block)), wait, timeout)

    def contains(self, key: BlockKey) -> bool:
        """Whether this process wrote or read the block and still trusts the store to hold it
        (no I/O). Not a lookup: the cache asks the store itself with probe()."""
        return self._is_known(remote_key(key))

    def delete(self, key: BlockKey) -> bool:
        """UNLINK the block from the store (through the breaker). True when the store had it."""
        rk = remote_key(key)
        self._forget(rk)
        status, got = self._call("delete", lambda c: c.unlink(rk))
        if status == "ok" and got:
            self.events.removed([key.hash], REMOTE)
        return status == "ok" and bool(got)

    def flush(self, timeout: float | None = None, since: int | None = None) -> bool:
        """Wait until every queued write was sent. True when none was lost meanwhile (or since
        `since`, a write_failures() mark)."""
        return self._writer.flush(timeout, since)

    def write_failures(self) -> int:
        """A mark for flush(since=...): taken before queueing writes, a flush then also sees the
        batches that failed before it began waiting."""
        return self._writer.failures()

    def close(self, timeout: float | None = 10.0) -> None:
        """Send what is queued (bounded), stop the writer, close the connections."""
        self._writer.flush(timeout)
        self._writer.stop()
        with self._lock:
            pool, self._decode_pool = self._decode_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._client_lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def _encode(self, it: WriteItem) -> None:
        """A raw block's payload (bound to hash || namespace), on the writer's encode pool before its
        batch is sent; skipped for a block the store is known to hold. Raises when it cannot encode."""
        if it.payload is not None or self._is_known(remote_key(it.key)):
            return
        block = it.block.contiguous()
        it.payload = self.codec.encode(block, payload_binding(it.key.hash, it.key.namespace))
        it.raw_size = block.numel() * block.element_size()

    def _write_batch(self, items: list[WriteItem]) -> bool:
        """The writer thread's batch (raw blocks encoded by _encode on the pool): SET every block in
        one pipeline. True when the store took every block."""
        cmds, sent = [], []
        for it in items:
            rk = remote_key(it.key)
            if self._is_known(rk):
                continue
            if it.payload is None:     # skipped by _encode as known, and no longer trusted since
                try:
                    self._encode(it)
                except Exception:
                    log.exception("remote tier: encoding block %s failed", it.key.hash.hex()[:16])
                    self._count(write_errors=1)
                    continue
            value = pack_value(it.key, it.payload, it.raw_size)
            cmds.append(("SET", rk, value) + (("PX", self.ttl_ms) if self.ttl_ms else ()))
            sent.append((it.key, rk, len(value)))
        if not cmds:
            return True
        status, got = self._call("set", lambda c: pipeline(c, cmds))
        if status != "ok":
            # Not sent (breaker open: a drop) or lost with the batch (the call failed).
            self._count(**{"write_drops" if status == "skipped" else "write_errors": len(cmds)})
            return False
        landed = []
        for (key, rk, n), r in zip(sent, got):
            if isinstance(r, Exception):
                self._count(write_errors=1)
                self._note_error("set", r)
                continue
            landed.append(key)
            self._count(writes=1, bytes_written=n)
            self._remember(rk)
        self.events.stored(landed, REMOTE)
        return len(landed) == len(sent)

    # ---- the client ------------------------------------------------------------------------
    def _call(self, what: str, fn) -> tuple[str, object]:
        """fn(client) through the breaker: ("ok", its result), or ("skipped" | "failed", None)
        (counted; a failure logged)."""
        if not self.breaker.allow():
            self._count(skipped=1)
            return "skipped", None
        try:
            out = fn(self._client())
        except Exception as e:   # noqa: BLE001 -- any failure of the store is a miss, never a failed request
            from redis.exceptions import ResponseError
            if isinstance(e, ResponseError) and not is_unavailable(e):
                self.breaker.success()       # it answered: a refusal is not an outage
            else:
                self.breaker.failure()
                self._count(errors=1)
            self._note_error(what, e)
            return "failed", None
        self.breaker.success()
        return "ok", out

    def _client(self):
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = self._build_client()
            return self._client_obj

    def _build_client(self):
        return make_client(self.url, self.timeout_s)


    def _decoder(self) -> ThreadPoolExecutor:
        """The pool that verifies and decodes values (zstd and the copies release the GIL)."""
        with self._lock:
            if self._decode_pool is None:
                self._decode_pool = ThreadPoolExecutor(self._decode_threads, thread_name_prefix="tieredkv-remote-decode",
                                                       initializer=background_priority)
            return self._decode_pool

    # ---- bookkeeping -----------------------------------------------------------------------
    def _remember(self, rk: bytes) -> None:
        with self._lock:
            self._known[rk] = time.monotonic() + self._known_s
            self._known.move_to_end(rk)
            if len(self._known) > _KNOWN_MAX:
                self._known.popitem(last=False)

    def _forget(self, rk: bytes) -> None:
        with self._lock:
            self._known.pop(rk, None)

    def _is_known(self, rk: bytes) -> bool:
        with self._lock:
            until = self._known.get(rk)
            if until is not None and until < time.monotonic():
                del self._known[rk]
                return False
            return until is not None

    def _forget_known(self) -> None:
        with self._lock:
            self._known.clear()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._c[k] += v

    def _note_error(self, what: str, e: BaseException) -> None:
        msg = f"{what}: {type(e).__name__}: {e}"
        now = time.monotonic()
        with self._lock:
            self._last_error = msg
            if now - self._last_log < _LOG_EVERY_S:
                return           # one line per 10 s: a dead store is called on every lookup
            self._last_log = now
        log.warning("remote tier %s: %s (a miss; breaker %s)", self.url.redacted, msg, self.breaker.state)

    def stats(self) -> RemoteStats:
        with self._lock:
            c, last = dict(self._c), self._last_error
        return RemoteStats(enabled=True, url=self.url.redacted, cluster=self.url.cluster, breaker=self.breaker.state,
                           breaker_opened=self.breaker.opened, pending_writes=self._writer.pending_count(),
                           last_error=last, **c)


