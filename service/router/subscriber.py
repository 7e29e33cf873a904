"""One backend's KV-event stream, applied to the index: a ZMQ SUB socket, gaps filled by replay.

Knows: the order of things. On start it connects the SUB socket first, then asks the replay
socket for everything buffered from seq 0 (a router that just started, or restarted, rebuilds
its picture of the backend this way: the router keeps no state of its own), and only then reads
the live stream, skipping what the replay already applied. A live batch whose seq is more than
one past the last applied is a gap: the missed range is asked for on the replay socket. What
the publisher no longer buffers, or a replay that is not answered within `replay_timeout_s`, is
counted as lost and skipped (the index is a hint: a block it wrongly thinks a backend holds costs
one routing decision, never a failed request).
Where the backend's sockets take CURVE keys (its status names a `server_key`), both of ours are
CURVE clients with the router's keypair (`CurveClient`): a backend that does not allow it gives
them no handshake, so nothing arrives (the sync's replay times out, counted as a failure).
Doesn't know: when a backend restarted (backends.py sees a new instance, clears the backend's
entries and starts a fresh subscriber) or what the index does with a batch.
NOTE: runs on the event loop (zmq.asyncio), like everything that touches the index.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from service.router.events import REPLAY_END, BadBatch, decode_batch, seq_bytes, seq_of
from service.router.index import PrefixIndex
from storage.kv_events.keys import CurveKeypair

log = logging.getLogger("tieredkv.router")
RCV_HWM = 100_000          # batches the SUB socket queues while a replay is under way


@dataclass
class SubscriberStats:
    batches: int = 0        # applied, live or replayed
    events: int = 0
    replayed: int = 0       # batches applied from replay
    replays: int = 0        # replay requests sent
    gaps: int = 0           # live gaps seen
    lost: int = 0           # batches neither the stream nor the replay delivered
    bad: int = 0            # payloads that were not KVEventBatch (or that the index could not apply)
    replay_failures: int = 0
    running: int = 1        # 0 once the feed stopped for good (an error outside any one batch): /health, /metrics


@dataclass(frozen=True)
class CurveClient:
    """The router's keypair and the backend's public key (Z85), for a backend whose sockets take CURVE."""
    keypair: CurveKeypair
    server_key: bytes

    def secure(self, sock: zmq.asyncio.Socket) -> None:
        """Make `sock` a CURVE client of the backend (before it connects)."""
        sock.curve_secretkey = self.keypair.secret
        sock.curve_publickey = self.keypair.public
        sock.curve_serverkey = self.server_key


class EventSubscriber:
    def __init__(self, backend: str, endpoint: str, replay_endpoint: str | None, topic: str,
                 index: PrefixIndex, context: zmq.asyncio.Context, replay_timeout_s: float = 2.0,
                 curve: CurveClient | None = None) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.curve = curve
        self.last_seq = -1
        self.stats = SubscriberStats()
        self.synced = asyncio.Event()      # set once the first replay (or its failure) is done
        self._task: asyncio.Task | None = None
        self._dealer: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._replay(0)
            self.synced.set()
            while True:
                parts = await sub.recv_multipart()
                if len(parts) != 3:
                    self.stats.bad += 1
                    continue
                try:
                    seq = seq_of(parts[1])
                except BadBatch:
                    self.stats.bad += 1
                    continue
                if seq <= self.last_seq:
                    continue                         # already applied (replay overlap)
                if seq > self.last_seq + 1:
                    self.stats.gaps += 1
                    await self._replay(self.last_seq + 1)
                    if seq <= self.last_seq:
                        continue
                    if seq > self.last_seq + 1:      # the replay could not fill it all
                        self.stats.lost += seq - self.last_seq - 1
                self._apply(seq, parts[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.running = 0
            log.exception("kv events of %s: the subscriber stopped", self.backend)
        finally:
            self.synced.set()
            sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)
                self._dealer = None

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.secure(sock)
        return sock

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch. NOTE invariant: no batch stops the feed -- anything wrong with one is
        counted (`bad`), logged and skipped, and the next batch is read."""
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except BadBatch as e:
            self.stats.bad += 1
            log.warning("kv events of %s: batch %d is not a KVEventBatch: %s", self.backend, seq, e)
            return
        try:
            self.index.apply_batch(self.backend, batch)
        except Exception:          # noqa: BLE001 -- one batch, not the feed
            self.stats.bad += 1
            log.exception("kv events of %s: batch %d could not be applied; skipped", self.backend, seq)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)

    async def _replay(self, start: int) -> None:
        """Apply the buffered batches from `start` on (the live stream then skips what was
        applied). A missing or silent replay socket loses the range. From 0 (a first sync),
        history the publisher no longer buffers is not counted as lost: it was never known."""
        if self.replay_endpoint is None:
            return
        if self._dealer is None:
            self._dealer = self._socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        self.stats.replays += 1
        try:
            await self._dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                parts = await asyncio.wait_for(self._dealer.recv_multipart(), self.replay_timeout_s)
                if len(parts) != 3:
                    self.stats.bad += 1
                    continue
                seq = seq_of(parts[1])
                if seq == REPLAY_END:
                    return
                if seq <= self.last_seq:
                    continue
                if start > 0 and seq > self.last_seq + 1:
                    self.stats.lost += seq - self.last_seq - 1       # no longer buffered
                self._apply(seq, parts[2])
                self.stats.replayed += 1
        except (asyncio.TimeoutError, BadBatch, zmq.ZMQError) as e:
            # NOTE: a late answer to this request must not be read as the next one's: a new socket.
            self.stats.replay_failures += 1
            log.warning("kv events of %s: replay from %d failed (%s); that range is lost%s", self.backend, start,
                        type(e).__name__, "" if self.curve is None else
                        f" (a backend that does not allow the router's key {self.curve.keypair.public.decode()} "
                        "answers nothing: is it among its --kv-events-allow-keys?)")
            self._dealer.close(linger=0)
            self._dealer = None
