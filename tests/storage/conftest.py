import functools

import torch

from storage.fleet_secret import FleetSecret, load_fleet_secret
from storage.layout import BlockLayout
from storage.hashing import block_keys


@functools.cache
def fleet() -> FleetSecret:
    """The fleet secret the suite's remote tiers seal under: the sandbox's default file (made on
    first use, under the cache root tests/sandbox.py sets -- so never at import, which comes before
    the sandbox), the one every CacheConfig without a cache_secret_file reads too: a tier built in
    a test and a cache built from a config share blocks."""
    return load_fleet_secret()


# A tiny layout: 2 layers, block of 4 tokens, 2 kv heads, head_dim 8 -> 256 elements per block.
TINY = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
NS = b"\x01" * 32


def keys(n: int, start_token: int = 0, layout: BlockLayout = TINY, ns: bytes = NS):
    """n chained block keys over tokens start_token, start_token+1, ..."""
    toks = list(range(start_token, start_token + n * layout.block_size))
    return block_keys(ns, toks, layout.block_size)


def block_data(key, layout: BlockLayout = TINY) -> torch.Tensor:
    """Deterministic bytes for a block, derived from its hash (so every block differs)."""
    g = torch.Generator().manual_seed(int.from_bytes(key.hash[:8], "little"))
    return torch.randn(layout.shape, generator=g).to(layout.dtype)
