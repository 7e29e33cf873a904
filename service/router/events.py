"""vLLM's KV-event wire format, as the router reads it.

A publisher sends multipart ZMQ messages `[topic, seq, payload]`: seq is 8 bytes big-endian,
payload is msgpack of vLLM's `KVEventBatch` (storage/kv_events/wire.py declares the structs, once,
for our publisher and this decoder):

    [ts, [event, ...], data_parallel_rank]   (vLLM's publisher sends its rank, 0 for one server)
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

medium is each tier kind's own (storage/tier_kinds.py: "GPU" the device pool, "CPU" host, "DISK",
"REMOTE", and any kind registered since, read there at each use: index.py, policy.py); None means GPU (vLLM's default). Replay (a DEALER to the publisher's ROUTER): send `[b"", start_seq]`, receive
`[b"", seq, payload]` per buffered batch with seq >= start, then `[b"", -1, b""]`.

Knows: decoding the format. Decoding is positional and tolerant (a batch of two fields, trailing
fields newer vLLM versions add are ignored; an event with an unknown tag is skipped; vLLM's int
block hashes become bytes), so a publisher a version ahead still routes; a batch or an event sent
as a map (msgspec's tagged structs without array_like: `{"type": "BlockStored", "block_hashes":
...}`, `{"ts": ..., "events": [...]}`) is read by field name. Anything else malformed -- a ts that
is not a number, a medium that is not a string, a field of the wrong type -- is BadBatch, and so
is a batch past MAX_PAYLOAD_BYTES or MAX_BATCH_HASHES (a flood must not stall the router's loop:
a 1M-hash batch took it 1.76 s and +330 MB; our publisher sends at most 4,096 blocks a batch).
Doesn't know: sockets (subscriber.py) or what the events mean for routing (index.py).
"""
from __future__ import annotations

from typing import Any

import msgspec

from storage.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch

REPLAY_END = -1
MAX_PAYLOAD_BYTES = 16 << 20
MAX_BATCH_HASHES = 65_536
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")
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


def _medium(m: Any) -> str | None:
    if m is not None and not isinstance(m, str):
        raise BadBatch(f"medium: expected a string or None, got {type(m).__name__}")
    return m


def _list(v: Any, what: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise BadBatch(f"{what}: expected a list, got {type(v).__name__}")
    return list(v)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):                 # a tagged map: fields by name, the tag under "type"
        tag = raw.get("type")
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        raw = [tag, *(raw.get(n) for n in names)]
        if tag == "BlockStored" and raw[4] is None:
            raise BadBatch("BlockStored: expected block_size")
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise BadBatch(f"event: expected [tag, ...], got {raw!r:.80}")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        if len(fields) < 4:
            raise BadBatch(f"BlockStored: expected at least 4 fields, got {len(fields)}")
        fields += [None] * (6 - len(fields))
        hashes, parent, tokens, block_size, lora_id, medium = fields[:6]
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise BadBatch(f"BlockStored: block_size must be an int, got {type(block_size).__name__}")
        tokens = [] if tokens is None else _list(tokens, "token_ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadBatch("BlockStored: token_ids must be ints")
        return BlockStored(block_hashes=[_hash(h) for h in _list(hashes, "block_hashes")],
                           parent_block_hash=None if parent is None else _hash(parent),
                           token_ids=tokens, block_size=block_size, lora_id=lora_id, medium=_medium(medium))
    if tag == "BlockRemoved":
        if not fields:
            raise BadBatch("BlockRemoved: expected block_hashes")
        return BlockRemoved(block_hashes=[_hash(h) for h in _list(fields[0], "block_hashes")],
                            medium=_medium(fields[1] if len(fields) > 1 else None))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None       # a kind this router does not know: skipped


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in `payload`, or BadBatch (never another exception) for anything malformed."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadBatch(f"batch: {len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise BadBatch(f"not msgpack: {e}") from None
    if isinstance(raw, dict):                 # a map: fields by name
        raw = [raw.get("ts"), raw.get("events")]
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise BadBatch(f"batch: expected [ts, [events...]], got {raw!r:.80}")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts in (float("inf"), float("-inf")):
        raise BadBatch(f"batch: ts must be a finite number, got {ts!r:.40}")
    hashes = sum(_hash_count(r) for r in raw[1])       # counted before any is converted
    if hashes > MAX_BATCH_HASHES:
        raise BadBatch(f"batch: {hashes} block hashes, over {MAX_BATCH_HASHES}")
    try:
        events = [e for e in (_event(r) for r in raw[1]) if e is not None]
    except BadBatch:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError, msgspec.ValidationError) as e:
        raise BadBatch(f"{type(e).__name__}: {e}") from None
    return KVEventBatch(ts=float(ts), events=events)


def _hash_count(raw: Any) -> int:
    hashes = raw.get("block_hashes") if isinstance(raw, dict) else \
        raw[1] if isinstance(raw, (list, tuple)) and len(raw) > 1 else None
    return len(hashes) if isinstance(hashes, (list, tuple)) else 0


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
