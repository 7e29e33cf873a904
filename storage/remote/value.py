"""A block as the remote store holds it: its key and its value frame.

Knows: the key scheme -- `tkv:r1:<namespace hex>:<block hash hex>`: the namespace digests the model
identity and the tenant's cache salt, so two tenants never read each other's blocks even through a
store every server shares; no {hash tag}, so blocks spread over a cluster's slots -- and the value
frame `b"TKR1" | u32 meta length | BlockMeta | codec payload` (storage/codec/stored_block.py).
Doesn't know: the store, or whether a value is sound (RemoteTier verifies each read).
"""
from __future__ import annotations

import struct
import time
from collections.abc import Sequence

from storage.codec.stored_block import BlockMeta
from storage.hashing import BlockKey

KEY_PREFIX = b"tkv:r1:"       # bump r1 when the value format changes: old values are then never read
VALUE_MAGIC = b"TKR1"
_META_LEN = struct.Struct("<I")


def remote_key(key: BlockKey) -> bytes:
    """The store key of a block: derived from its namespace and hash (tenant isolation)."""
    return KEY_PREFIX + key.namespace.hex().encode() + b":" + key.hash.hex().encode()


def pack_value(key: BlockKey, payload: bytes | Sequence[bytes | memoryview], raw_size: int) -> bytes:
    """The stored value: metadata (checked on every read) then the codec payload -- given whole,
    or as Codec.encode_parts' parts, joined here in the value's one copy."""
    parts = (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else tuple(payload)
    size = sum(memoryview(p).nbytes for p in parts)
    meta = BlockMeta(key.parent, key.namespace, key.token_ids, raw_size, size, time.time(), 0, 0).pack()
    return b"".join((VALUE_MAGIC, _META_LEN.pack(len(meta)), meta, *parts))


def unpack_value(value: bytes) -> tuple[memoryview | None, memoryview | None]:
    """(meta, payload) views of a stored value; (None, None) when the framing itself is damaged."""
    mv = memoryview(value)
    if len(mv) < len(VALUE_MAGIC) + _META_LEN.size or bytes(mv[:4]) != VALUE_MAGIC:
        return None, None
    (n,) = _META_LEN.unpack_from(mv, 4)
    start = 4 + _META_LEN.size
    if start + n > len(mv):
        return None, None
    return mv[start:start + n], mv[start + n:]
