"""Block identity: the namespace digest and the chained 32-byte block hashes.

Knows: how a model identity and a tenant become a namespace, and how a token sequence
becomes a chain of block keys (`h_i = H(h_{i-1} || tokens_i)`, `h_-1 = H(namespace)`).
Deterministic across processes and restarts (never Python's `hash()`); sha256 because
tenants share one store and a collision would serve one tenant's KV to another.
Doesn't know: where blocks live, or what a model is beyond its identity fields.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

# Bump when the block bytes or the hashing scheme change: old caches then never hit.
FORMAT_VERSION = 1
HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What makes two models' KV interchangeable: name, a digest of the config, dtype."""
    name: str
    config_digest: str
    dtype: str


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One full block of a token sequence: its chained hash, its parent's hash, its tokens.

    The tokens are stored beside the block in every tier and checked on a hit, so a hash
    collision or a damaged index can never serve another prefix's KV.
    """
    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    namespace: bytes


def _sha256(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


def config_digest(config: dict) -> str:
    """A stable hex digest of a model config dict (sorted JSON)."""
    import json
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tenant_salt(tenant: str, isolate_tenants: bool = True) -> str:
    """The cache salt of a tenant: its name when tenants are isolated, "" when they share."""
    return f"tenant:{tenant}" if isolate_tenants else ""


def namespace_digest(model: ModelIdentity, block_size: int, tenant_salt: str | bytes = b"") -> bytes:
    """The root of every hash chain: model identity + block size + format version + tenant salt."""
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else bytes(tenant_salt)
    fields = [b"tieredkv", str(FORMAT_VERSION).encode(), model.name.encode(), model.config_digest.encode(),
              model.dtype.encode(), str(block_size).encode(), salt]
    # Length-prefix each field so ("ab", "c") and ("a", "bc") differ.
    return _sha256(*(struct.pack("<I", len(f)) + f for f in fields))


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """h_i = sha256(h_{i-1} || little-endian uint32 token ids)."""
    return _sha256(parent, _tokens_bytes(tokens))


def root_hash(namespace: bytes) -> bytes:
    """h_-1 = H(namespace): the parent of a sequence's first block."""
    return _sha256(namespace)


def block_keys(namespace: bytes, token_ids: Sequence[int], block_size: int,
               max_tokens: int | None = None, start: int = 0, parent: bytes | None = None) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` (the tail that does not fill a block has none).

    max_tokens caps how many tokens may be covered (a prompt hit is capped at len - 1 so at
    least one token is computed). start/parent continue a chain from block `start`.
    """
    n = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    prev = root_hash(namespace) if parent is None else parent
    keys = []
    for b in range(start, n // block_size):
        toks = tuple(int(t) for t in token_ids[b * block_size:(b + 1) * block_size])
        h = hash_block(prev, toks)
        keys.append(BlockKey(h, prev, toks, namespace))
        prev = h
    return keys
