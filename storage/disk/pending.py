"""A put awaiting its commit: what the disk writer's queue holds, and how a read serves it.

Knows: the block's raw bytes (or, for a block the remote tier read and verified, its payload
already encoded), and how such a block is served for a key before it reaches LMDB (copy_for:
only for the very key that put it). Doesn't know: the queue or the commit (storage/disk/writer.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage.codec.codec_error import CodecError
from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding
from storage.hashing import BlockKey

if TYPE_CHECKING:      # blocks are tensors, but nothing here makes one: `tieredkv inspect`/`verify` load no torch
    import torch


@dataclass(slots=True)
class PendingBlock:
    """A put awaiting its commit: the block's raw bytes, or (a block the remote tier read and
    verified) the payload already encoded, which is stored as it is and decoded for a read."""
    key: BlockKey
    block: torch.Tensor | None
    payload: bytes | memoryview | None = None     # encoded, bound to hash || namespace
    raw_size: int = 0                             # the block's bytes (when only `payload` is kept)

    @property
    def nbytes(self) -> int:
        return self.raw_size if self.block is None else self.block.numel() * self.block.element_size()

    def copy_for(self, key: BlockKey, out: torch.Tensor | None, codec: Codec) -> torch.Tensor | None:
        """This pending block served for `key` (into `out` if given); None when the key or `out`
        does not match it."""
        if (self.key.token_ids, self.key.namespace, self.key.parent) != (key.token_ids, key.namespace, key.parent):
            return None
        if self.block is None:
            try:
                return codec.decode(self.payload, payload_binding(key.hash, key.namespace), out)
            except (CodecError, ValueError):
                return None
        if out is None:
            return self.block.clone()
        if out.numel() != self.block.numel() or out.dtype != self.block.dtype or not out.is_contiguous():
            return None
        return out.view(self.block.shape).copy_(self.block)
