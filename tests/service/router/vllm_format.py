"""vLLM's KV-event structs, written from its documented format (vllm/distributed/kv_events.py),
with no vLLM import: msgspec structs, array_like, tagged by class name. Tests encode batches with
them exactly as a vLLM publisher would, and a fake publisher speaks vLLM's ZMQ protocol.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Union

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of every event: the class name is the tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


ENCODER = msgspec.msgpack.Encoder()


def encode(events: list, ts: float = 0.0) -> bytes:
    return ENCODER.encode(KVEventBatch(ts=ts, events=events))


def stored(hashes: list[bytes], medium: str | None = "GPU", parent: bytes | None = None, block_size: int = 8) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(block_size * len(hashes))),
                       block_size=block_size, lora_id=None, medium=medium)


def removed(hashes: list[bytes], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


class FakePublisher:
    """vLLM's ZmqEventPublisher's protocol on loopback: PUB `[topic, seq, payload]` and a ROUTER
    replay socket answering `[b"", start]` with every buffered batch from start, then seq -1.
    `publish(payload, send=False)` buffers a batch without sending it live (a gap). With `access`
    (storage/kv_events/access.py) both sockets are CURVE servers admitting its keys alone."""

    def __init__(self, topic: str = "", access=None) -> None:
        self.ctx = zmq.Context()
        self.gate = None
        if access is not None:
            from storage.kv_events.access import Gate
            self.gate = Gate(self.ctx, access)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        if self.gate is not None:
            self.gate.secure(self.pub)
            self.gate.secure(self.replay)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        rport = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.topic = topic.encode()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, send: bool = True) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if send:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _, start_raw = self.replay.recv_multipart()
            start = int.from_bytes(start_raw, "big")
            self.replay_requests.append(start)
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in batches:
                self.replay.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
            self.replay.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()
