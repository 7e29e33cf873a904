"""A block as every tier below the host stores it: its metadata record beside its codec payload.

Knows: the BlockMeta record (parent, namespace, token ids, sizes; the disk's LRU fields ride
along, zero in the remote store) and how it is packed, what a payload is bound to (block hash ||
namespace, inside the codec's checked header), and the check a stored block passes before it is
served: it must be the block the key names (tokens, namespace, parent), agree with its metadata
and the layout, and decode (verify_and_decode; check_stored decodes without a tensor, so
without torch). The disk tier (its `meta` and `payload` databases) and the remote tier (one
value holding both) share all of it.
Doesn't know: where the record is kept, or what to do about damage (the tiers count and delete).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage.codec.codec_error import CodecError
from storage.codec.header import CodecHeader
from storage.codec.payload import Codec
from storage.hashing import BlockKey
from storage.layout import BlockLayout, dtype_name

if TYPE_CHECKING:      # a tensor only where one is decoded into (verify_and_decode); check_stored needs none
    import torch

_META_FIXED = struct.Struct("<B32sQQdQQHI")
_META_VERSION = 1


@dataclass(slots=True)
class BlockMeta:
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    raw_size: int
    stored_size: int
    created: float
    last_access: int
    reads: int                 # gets that returned it (the LRU's access count)

    def pack(self) -> bytes:
        return (_META_FIXED.pack(_META_VERSION, self.parent, self.raw_size, self.stored_size, self.created,
                                 self.last_access, self.reads, len(self.namespace), len(self.token_ids))
                + self.namespace + struct.pack(f"<{len(self.token_ids)}I", *self.token_ids))

    @staticmethod
    def unpack(buf: bytes | memoryview) -> "BlockMeta":
        """Raises ValueError for a damaged record."""
        try:
            v, parent, raw, stored, created, last, reads, ns_len, n_tok = _META_FIXED.unpack_from(buf, 0)
        except struct.error as e:
            raise ValueError(f"metadata record damaged: {e}") from None
        if v != _META_VERSION or len(buf) != _META_FIXED.size + ns_len + 4 * n_tok:
            raise ValueError("metadata record damaged: bad version or length")
        ns = bytes(buf[_META_FIXED.size:_META_FIXED.size + ns_len])
        toks = struct.unpack_from(f"<{n_tok}I", buf, _META_FIXED.size + ns_len)
        return BlockMeta(parent, ns, toks, raw, stored, created, last, reads)

    @staticmethod
    def token_count(head: bytes | memoryview) -> int | None:
        """The token count from a record's first FIXED_SIZE bytes (None if they are not a
        record's): a listing reads it without fetching the whole record."""
        if len(head) < _META_FIXED.size:
            return None
        fixed = _META_FIXED.unpack_from(head, 0)
        return fixed[-1] if fixed[0] == _META_VERSION else None


META_FIXED_SIZE = _META_FIXED.size    # bytes of a BlockMeta record before its namespace and tokens


def payload_binding(h: bytes, namespace: bytes) -> bytes:
    """What a stored payload is bound to (codec header): its block hash and namespace. The hash
    chains the parent and token ids, so a payload can serve one block of one namespace only."""
    return h + namespace


def verify_and_decode(codec: Codec, layout: BlockLayout | None, key: BlockKey, out: torch.Tensor | None,
                      payload: bytes | memoryview | None, meta_raw: bytes | memoryview | None, head: int = 0
                      ) -> tuple[torch.Tensor | None, str | None]:
    """(the decoded block, None) when the stored record is the block `key` names and sound,
    else (None, the reason). `out`, when given, receives the bytes. `head`: bytes the stored
    record held before the payload (a sealed disk record's seal: storage/disk/seal.py), which
    its metadata's stored size counts."""
    header, reason = _checked(codec, layout, key, out, payload, meta_raw, head)
    if header is None:
        return None, reason
    try:
        return codec.decode(payload, payload_binding(key.hash, key.namespace), out, header=header), None
    except CodecError as e:
        return None, f"codec: {e}"


def check_stored(codec: Codec, layout: BlockLayout | None, key: BlockKey, payload: bytes | memoryview | None,
                 meta_raw: bytes | memoryview | None, head: int = 0) -> str | None:
    """verify_and_decode's every check, its full decode included, without making a tensor
    (Codec.check: no torch, so `tieredkv verify` runs without importing it): None when sound,
    else the reason."""
    header, reason = _checked(codec, layout, key, None, payload, meta_raw, head)
    if header is None:
        return reason
    try:
        codec.check(payload, payload_binding(key.hash, key.namespace), header=header)
    except CodecError as e:
        return f"codec: {e}"
    return None


def _checked(codec: Codec, layout: BlockLayout | None, key: BlockKey, out: torch.Tensor | None,
             payload: bytes | memoryview | None, meta_raw: bytes | memoryview | None, head: int = 0
             ) -> tuple[CodecHeader | None, str | None]:
    """(the payload's checked header, None) when the record is the block `key` names and agrees
    with its metadata, the layout and `out`; else (None, the reason)."""
    if payload is None or meta_raw is None:
        return None, "payload missing" if payload is None else "metadata missing"
    try:
        m = BlockMeta.unpack(meta_raw)
    except ValueError as e:
        return None, str(e)
    if m.token_ids != key.token_ids:
        return None, "stored token ids differ from the key's"
    if m.namespace != key.namespace:
        return None, "stored namespace differs from the key's"
    if m.parent != key.parent:
        return None, "stored parent differs from the key's"
    if m.stored_size != head + len(payload):
        return None, f"record is {head + len(payload)} bytes, metadata says {m.stored_size}"
    try:
        # NOTE invariant: the header's crc32 is verified here, once, before any of its fields is
        # compared or used; decode()/check() then check the binding, the coded crc32 and each
        # frame's checksum (or the raw codec's xxh3) before a byte is served.
        header = codec.check_header(payload)
    except CodecError as e:
        return None, f"codec: {e}"
    if header.raw_size != m.raw_size:
        return None, f"header raw size {header.raw_size} != metadata's {m.raw_size}"
    if layout is not None and (header.dtype != dtype_name(layout.dtype) or header.shape != layout.shape):
        return None, f"block is {header.shape} {header.dtype}, layout wants {layout.shape}"
    if out is not None and (dtype_name(out.dtype) != header.dtype or out.numel() != header.numel):
        return None, f"block is {header.shape} {header.dtype}, does not fit out"
    return header, None
