"""vLLM's KV-event wire format, as the router reads it.

A publisher sends multipart ZMQ messages `[topic, seq, payload]`: seq is 8 bytes big-endian,
payload is msgpack of vLLM's `KVEventBatch` (storage/kv_events/wire.py declares the structs, once,
for our publisher and this decoder):

    [ts, [event, ...], data_parallel_rank]   (vLLM's publisher sends its rank, 0 for one server)
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

medium is "GPU" (the device pool), "CPU" (host), "DISK" or "REMOTE"; None means GPU (vLLM's
default). Replay (a DEALER to the publisher's ROUTER): send `[b"", start_seq]`, receive
`[b"", seq, payload]` per buffered batch with seq >= start, then `[b"", -1, b""]`.

Knows: decoding the format. Decoding is positional and tolerant (a batch of two fields, trailing
fields newer vLLM versions add are ignored; an event with an unknown tag is skipped; vLLM's int
block hashes become bytes), so a publisher a version ahead still routes. Doesn't know: sockets
(subscriber.py) or what the events mean for routing (index.py).
"""
from __future__ import annotations

from typing import Any

import msgspec

from storage.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch

MEDIA = ("GPU", "CPU", "DISK", "REMOTE")
REPLAY_END = -1
_ENCODER = msgspec.msgpack.Encoder()


class BadBatch(ValueError):
    """A payload that is not a KVEventBatch."""


def _hash(h: Any) -> bytes:
    # vLLM's ExternalBlockHash is bytes or int; tieredkv sends its 32-byte keys.
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return h.to_bytes(max(8, (h.bit_length() + 8) // 8), "big", signed=True)
    raise BadBatch(f"block hash: expected bytes or int, got {type(h).__name__}")


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise BadBatch(f"event: expected [tag, ...], got {raw!r:.80}")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        if len(fields) < 4:
            raise BadBatch(f"BlockStored: expected at least 4 fields, got {len(fields)}")
        fields += [None] * (6 - len(fields))
        hashes, parent, tokens, block_size, lora_id, medium = fields[:6]
        return BlockStored(block_hashes=[_hash(h) for h in hashes],
                           parent_block_hash=None if parent is None else _hash(parent),
                           token_ids=list(tokens or []), block_size=int(block_size), lora_id=lora_id, medium=medium)
    if tag == "BlockRemoved":
        if not fields:
            raise BadBatch("BlockRemoved: expected block_hashes")
        return BlockRemoved(block_hashes=[_hash(h) for h in fields[0]], medium=fields[1] if len(fields) > 1 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None       # a kind this router does not know: skipped


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise BadBatch(f"not msgpack: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise BadBatch(f"batch: expected [ts, [events...]], got {raw!r:.80}")
    try:
        events = [e for e in (_event(r) for r in raw[1]) if e is not None]
    except (TypeError, ValueError) as e:
        raise BadBatch(str(e)) from None
    return KVEventBatch(ts=float(raw[0]), events=events)


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int | None = None) -> bytes:
    """msgpack of a KVEventBatch as vLLM's structs encode it (tests and tools): the rank as given,
    None as the struct's default writes it (a vLLM server fills in its rank, 0 for one server)."""
    return _ENCODER.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadBatch(f"seq: expected 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)
