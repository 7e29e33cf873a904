"""The KV-event wire format, declared as vLLM declares it (vllm/distributed/kv_events.py, the
array-like releases that carry `medium`): msgspec structs, array-like (a struct is a msgpack array
of its fields, in order; msgspec writes trailing defaults too), the events tagged with their class
name. Encoded with `msgspec.msgpack.Encoder()`, a batch is byte-for-byte what a vLLM server sends
(its publisher fills in its data-parallel rank, 0 for a single server, before encoding), so its
consumers decode ours unchanged:

    KVEventBatch  -> [ts, [event, ...], data_parallel_rank]
    BlockStored   -> ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved  -> ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared -> ["AllBlocksCleared"]

The one definition of these structs: the publisher encodes them, the router (service/router/
events.py) decodes into them. vLLM's newer releases append fields (lora_name, extra_keys, ...)
and its newest send events as tagged maps; neither is declared here (the router's decoder skips
trailing fields).

Knows: the structs. Doesn't know: sockets, sequence numbers or our tiers (storage/kv_events/
publisher.py maps tiers to media: "GPU" the device pool, "CPU" the host tier, "DISK", "REMOTE").
Block hashes are our 32-byte namespaced chain hashes (storage/hashing.py): a tenant's blocks never
share a hash with another tenant's.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of every event: tagged, so a batch's events decode to their own classes."""


class BlockStored(KVCacheEvent):
    """Blocks that became findable in `medium`: a chain (each block's parent is the one before
    it; the first's is `parent_block_hash`, None at the root), `token_ids` the chain's tokens in
    order (len(block_hashes) * block_size of them; empty when tokens are not published)."""
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that stopped being findable in `medium`."""
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Forget everything this publisher said before (sent first by every publisher that starts)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[Event]
