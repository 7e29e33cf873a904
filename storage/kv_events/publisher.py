"""The KV-event publisher: one thread that turns the sink's queue into numbered batches on a ZMQ
PUB socket, and answers replay requests on a ZMQ ROUTER socket, as vLLM's ZmqEventPublisher does.

Knows: the sockets (bound at construction, as storage/kv_events/access.py allows: CURVE and its
ZAP thread on a ZMQ context of the publisher's own, an ipc file closed to others; the endpoints
actually bound, a free port resolved, are `endpoint` and `replay_endpoint`), batching (the events
queued within `batch_s` of the first one, until `max_batch_events` blocks, become one
KVEventBatch), turning queued items into wire events (a run of blocks that chain -- each the
child of the one before -- in one medium is one BlockStored, as vLLM sends a request's new
blocks; the root block's parent is None, not our namespace digest; token ids only where `tokens`),
the sequence number (0 for the first batch, +1 per batch), and the ring replay serves from: the
last `buffer_batches` payloads, none older than `replay_s` by `clock` (an old batch drops out as
the next is sent or a replay is asked for).

On the wire (vLLM's): a batch is the multipart [topic, seq (8 bytes big-endian), payload]. A
replay request on the ROUTER socket is [client_id, b"", start_seq (8 bytes big-endian)]; the
answer is [client_id, b"", seq, payload] for every buffered batch with seq >= start_seq, then
[client_id, b"", -1 (8 bytes, signed), b""].
Doesn't know: the tiers (they call storage/kv_events/sink.py, whose queue this drains).

Threads (NOTE): the sockets are this thread's alone (ZMQ sockets are not thread-safe); other
threads read `seq`, `published` and the endpoints (plain ints and strings). Nothing here waits on
a subscriber: PUB drops at its high-water mark, ROUTER drops for a peer that does not read.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import msgspec
import zmq

from storage.hashing import BlockKey, root_hash
from storage.kv_events.access import Access, Gate, bind
from storage.kv_events.sink import EventSink
from storage.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("tieredkv.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05          # the longest a replay request waits while no event comes
_ROOTS_MAX = 4096       # namespaces whose root hash is remembered


class KVEventPublisher:
    def __init__(self, sink: EventSink, endpoint: str, replay_endpoint: str, *, block_size: int,
                 access: Access = Access(), topic: str = "", tokens: bool = False, buffer_batches: int = 10_000,
                 replay_s: float = 300.0, clock: Callable[[], float] = time.monotonic, batch_s: float = 0.005,
                 max_batch_events: int = 4096, hwm: int = 100_000, context: zmq.Context | None = None) -> None:
        access.check(endpoint, "kv_events")
        access.check(replay_endpoint, "kv_events_replay")
        if not replay_s > 0:
            raise ValueError(f"replay_s: expected seconds > 0, got {replay_s!r}")
        self.sink = sink
        self.topic = topic
        self.tokens = tokens
        self.block_size = block_size
        self.server_key = None if access.keypair is None else access.keypair.public.decode()
        self._topic = topic.encode()
        self._batch_s = batch_s
        self._max_events = max_batch_events
        self._replay_s = replay_s
        self._clock = clock
        # CURVE's ZAP handler belongs to a context: a publisher with keys has its own (one per
        # publisher, whatever else this process runs); inproc:// endpoints need the shared one.
        self._own_ctx = context is None and access.curve
        self._ctx = context or (zmq.Context() if access.curve else zmq.Context.instance())
        self._gate = Gate(self._ctx, access) if access.curve else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._pub.setsockopt(zmq.LINGER, 1000)    # the last batches still go out after close
        self._replay.setsockopt(zmq.LINGER, 0)
        # A replay of the whole ring is one message per batch: room for it (ROUTER drops past its
        # high-water mark, and the end marker must not be what is dropped).
        self._replay.setsockopt(zmq.SNDHWM, 2 * buffer_batches + 2)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        try:
            if self._gate is not None:
                self._gate.secure(self._pub)
                self._gate.secure(self._replay)
            self.endpoint = bind(self._pub, endpoint, "kv_events")
            self.replay_endpoint = bind(self._replay, replay_endpoint, "kv_events_replay")
        except BaseException:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            self._release_context()
            raise
        self._buffer: deque[tuple[int, float, bytes]] = deque(maxlen=buffer_batches)   # (seq, clock, payload)
        self._encoder = msgspec.msgpack.Encoder()
        self._roots: dict[bytes, bytes] = {}
        self.seq = -1            # the last batch's sequence number (-1: none sent yet)
        self.published = 0       # events sent
        self._stop = threading.Event()
        # A subscriber that restarts with us learns that what it knew of us is void.
        sink.cleared()
        self._thread = threading.Thread(target=self._run, name="tieredkv-kv-events", daemon=True)
        self._thread.start()

    def status(self) -> dict:
        """`server_key`: the CURVE public key a subscriber needs (Z85; None without keys)."""
        return {"enabled": True, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic, "seq": self.seq, "published": self.published, "dropped": self.sink.dropped,
                "tokens": self.tokens, "server_key": self.server_key, "replay_s": self._replay_s}

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets (and the ZAP thread, and the context where
        they are the publisher's own). Idempotent."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv events: the publisher did not stop within %.0f s; its sockets stay open", timeout)
            return
        self._release_context()

    def _release_context(self) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._own_ctx:
            self._own_ctx = False
            self._ctx.term()        # waits for the PUB socket's linger: the last batches go out

    # ---- the publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                items = self._take()
                if items:
                    self._send(items)
                elif self._stop.is_set():
                    return     # the queue is drained
        except Exception:
            log.exception("kv events: the publisher stopped; no more events are sent")
        finally:
            self._pub.close()
            self._replay.close()

    def _take(self) -> list[tuple]:
        """The items queued within batch_s of the first (waiting up to _POLL_S for it)."""
        q = self.sink.queue
        try:
            items = [q.get_nowait() if self._stop.is_set() else q.get(timeout=_POLL_S)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self._batch_s
        n = _blocks(items[0])
        while n < self._max_events:
            left = deadline - time.monotonic()
            try:
                items.append(q.get(timeout=left) if left > 0 else q.get_nowait())
            except queue.Empty:
                break
            n += _blocks(items[-1])
        return items

    def _send(self, items: list[tuple]) -> None:
        events = self._to_wire(items)
        if not events:
            return
        # vLLM's publisher fills in its data-parallel rank before encoding: 0 for one server.
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self.seq + 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass       # no subscriber keeps up: it replays from the buffer
        now = self._clock()
        self._expire(now)
        self._buffer.append((seq, now, payload))
        self.seq = seq
        self.published += len(events)

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self._expire(self._clock())
            for seq, _, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _expire(self, now: float) -> None:
        """Batches older than replay_s drop out of the ring (it holds history a subscriber may
        ask for: bounded in time as well as count)."""
        while self._buffer and self._buffer[0][1] < now - self._replay_s:
            self._buffer.popleft()

    def _to_wire(self, items: list[tuple]) -> list:
        events: list = []
        for item in items:
            kind = item[0]
            if kind == "cleared":
                events.append(AllBlocksCleared())
            elif kind == "removed":
                _, medium, hashes = item
                last = events[-1] if events else None
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.extend(hashes)
                else:
                    events.append(BlockRemoved(block_hashes=list(hashes), medium=medium))
            else:
                _, medium, keys = item
                for key in keys:
                    self._add_stored(events, key, medium)
        return events

    def _add_stored(self, events: list, key: BlockKey, medium: str) -> None:
        if len(key.token_ids) != self.block_size:
            return     # an exact entry's tail or logits block (storage/exact_entry.py): no prefix block
        last = events[-1] if events else None
        tokens = list(key.token_ids) if self.tokens else []
        if isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == key.parent:
            last.block_hashes.append(key.hash)      # the chain goes on: one event, as vLLM sends it
            last.token_ids.extend(tokens)
            return
        parent = None if key.parent == self._root(key.namespace) else key.parent
        events.append(BlockStored(block_hashes=[key.hash], parent_block_hash=parent, token_ids=tokens,
                                  block_size=self.block_size, lora_id=None, medium=medium))

    def _root(self, namespace: bytes) -> bytes:
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= _ROOTS_MAX:
                self._roots.clear()
            root = self._roots[namespace] = root_hash(namespace)
        return root


def _blocks(item: tuple) -> int:
    """How many blocks a queued item names (a clear: one)."""
    return len(item[2]) if len(item) > 2 else 1
