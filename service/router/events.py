"""vLLM's KV-event wire format, as the router reads it.

A publisher sends multipart ZMQ messages `[topic, seq, payload]`: seq is 8 bytes big-endian,
payload is msgpack of vLLM's `KVEventBatch` (msgspec structs, array_like, tagged):

    [ts, [event, ...], data_parallel_rank]   (vLLM sends the rank, None, even though it is a default)
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

medium is "GPU" (the device pool), "CPU" (host), "DISK" or "REMOTE"; None means GPU (vLLM's
default). Replay (a DEALER to the publisher's ROUTER): send `[b"", start_seq]`, receive
`[b"", seq, payload]` per buffered batch with seq >= start, then `[b"", -1, b""]`.

Knows: the format. Decoding is positional and tolerant (trailing fields newer vLLM versions add
are ignored; an event with an unknown tag is skipped), so a publisher a version ahead still routes.
Doesn't know: sockets (subscriber.py) or what the events mean for routing (index.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

MEDIA = ("GPU", "CPU", "DISK", "REMOTE")
REPLAY_END = -1


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[Event]


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
        return BlockStored([_hash(h) for h in hashes], None if parent is None else _hash(parent),
                           list(tokens or []), int(block_size), lora_id, medium)
    if tag == "BlockRemoved":
        if not fields:
            raise BadBatch("BlockRemoved: expected block_hashes")
        return BlockRemoved([_hash(h) for h in fields[0]], fields[1] if len(fields) > 1 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None       # a kind this router does not know: skipped


def decode_batch(payload: bytes) -> EventBatch:
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
    return EventBatch(float(raw[0]), events)


def encode_batch(ts: float, events: list[Event]) -> bytes:
    """msgpack of a KVEventBatch exactly as vLLM's msgspec structs encode it (tests and tools).
    NOTE: array_like structs keep trailing defaults: vLLM sends [ts, events, None] (its
    data_parallel_rank), which is what this writes; the decoder takes two or more fields."""
    out: list[list[Any]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                        e.medium])
        elif isinstance(e, BlockRemoved):
            out.append(["BlockRemoved", e.block_hashes, e.medium])
        else:
            out.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([ts, out, None])


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadBatch(f"seq: expected 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)
