"""A block as the remote store holds it: its key and its value frame.

Knows: the key scheme -- `tkv:r2:<namespace hex>:<block hash hex>`: the namespace digests the model
identity and the tenant's cache salt, so two tenants never read each other's blocks even through a
store every server shares; no {hash tag}, so blocks spread over a cluster's slots -- and the value
frame, sealed under the fleet secret (storage/fleet_secret.py):

    b"TKR2" | key id (8) | seal (32) | u32 meta length | BlockMeta | codec payload

The seal is the fleet secret's keyed BLAKE3 of the store key and every byte after the seal, so a
value opens only for the key it was written under, whole, and from a writer holding the secret.
`open_value` checks it before anything else reads the value; a value sealed under another secret
(another key id) is told apart from a forged or damaged one: the first is some other fleet's (or
a misconfigured member's) and is left alone, the second is deleted.
Doesn't know: the store, or whether a payload is sound (RemoteTier decodes and checks each read:
storage/codec/stored_block.py).

r1 values (unsealed, written before 2026-11-29) are never read: anyone who could write the store
could forge them.
"""
from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from storage.codec.stored_block import BlockMeta
from storage.fleet_secret import FOREIGN, SEAL_SIZE, FleetSecret  # noqa: F401 -- FOREIGN: Opened.problem, re-exported
from storage.hashing import BlockKey

KEY_PREFIX = b"tkv:r2:"       # bump r2 when the value format changes: old values are then never read
VALUE_MAGIC = b"TKR2"
_META_LEN = struct.Struct("<I")
_SEALED = len(VALUE_MAGIC) + SEAL_SIZE                  # where the sealed bytes begin
HEAD_SIZE = _SEALED + _META_LEN.size                    # magic, key id, seal, meta length


@dataclass(frozen=True, slots=True)
class Opened:
    """A stored value opened: its meta and payload (views of it) when the seal holds, else why not."""
    meta: memoryview | None
    payload: memoryview | None
    problem: str | None = None       # None: sound frame and seal; FOREIGN; or what is damaged

    @property
    def foreign(self) -> bool:
        return self.problem == FOREIGN


def remote_key(key: BlockKey) -> bytes:
    """The store key of a block: derived from its namespace and hash (tenant isolation)."""
    return KEY_PREFIX + key.namespace.hex().encode() + b":" + key.hash.hex().encode()


def pack_value(key: BlockKey, payload: bytes | Sequence[bytes | memoryview], raw_size: int,
               secret: FleetSecret) -> bytes:
    """The stored value: sealed (the parts hashed where they lie), metadata (checked on every
    read), then the codec payload -- given whole, or as Codec.encode_parts' parts, joined here in
    the value's one copy."""
    parts = (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else tuple(payload)
    size = sum(memoryview(p).nbytes for p in parts)
    meta = BlockMeta(key.parent, key.namespace, key.token_ids, raw_size, size, time.time(), 0, 0).pack()
    body = (_META_LEN.pack(len(meta)), meta, *parts)
    return b"".join((VALUE_MAGIC, secret.head(remote_key(key), body), *body))


def open_value(rkey: bytes, value: bytes | memoryview, secret: FleetSecret) -> Opened:
    """A stored value's meta and payload (views of `value`) once its frame and its seal for the
    key `rkey` hold; otherwise why not (FOREIGN for another secret's seal)."""
    mv = memoryview(value).cast("B") if not isinstance(value, memoryview) or value.format != "B" else value
    if len(mv) < HEAD_SIZE or bytes(mv[:4]) != VALUE_MAGIC:
        return Opened(None, None, "value framing damaged")
    _, problem = secret.open(rkey, mv[len(VALUE_MAGIC):])
    if problem is not None:
        return Opened(None, None, problem)
    (n,) = _META_LEN.unpack_from(mv, _SEALED)
    if HEAD_SIZE + n > len(mv):
        return Opened(None, None, "value framing damaged")
    return Opened(mv[HEAD_SIZE:HEAD_SIZE + n], mv[HEAD_SIZE + n:])

