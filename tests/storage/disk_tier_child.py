"""A second process for tests/storage/test_disk_tier.py, and the block/key recipe both share.

    python -m tests.storage.disk_tier_child write PATH CAPACITY START COUNT
        put blocks START..START+COUNT-1, close, print "done"
    python -m tests.storage.disk_tier_child forever PATH CAPACITY
        put blocks 0, 1, 2, ... without end; after each drain print "committed N"
    python -m tests.storage.disk_tier_child share PATH CAPACITY START COUNT OTHER_START
        put COUNT blocks from START, drain, print "written"; on the line "check" from stdin,
        read blocks OTHER_START..OTHER_START+COUNT-1 and print "seen K" (K bit-identical)

Block i is deterministic (seeded by i), its dtype cycles float32/float16/bfloat16, and its
key's first token is 16 * i, so any process can rebuild and check block i.
"""
from __future__ import annotations

import sys

import torch

from storage.disk.tier import DiskTier
from storage.hashing import BlockKey, hash_block, root_hash

NAMESPACE = bytes(range(32))
SHAPE = (2, 2, 16, 3, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def make_key(i: int, namespace: bytes = NAMESPACE) -> BlockKey:
    parent = root_hash(namespace)
    tokens = tuple(range(16 * i, 16 * i + 16))
    return BlockKey(hash_block(parent, tokens), parent, tokens, namespace)


def make_block(i: int, dtype: torch.dtype | None = None, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """KV-like values (scaled normals), deterministic in i."""
    g = torch.Generator().manual_seed(i)
    dtype = DTYPES[i % 3] if dtype is None else dtype
    return (torch.randn(shape, generator=g) * (1 + i % 5)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-identical comparison (NaN-safe)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def main(argv: list[str]) -> None:
    mode, path = argv[0], argv[1]
    capacity = int(argv[2])
    tier = DiskTier(path, capacity, queue_blocks=64, batch_blocks=8)
    if mode == "write":
        start, count = int(argv[3]), int(argv[4])
        for i in range(start, start + count):
            tier.put(make_key(i), make_block(i))
        tier.close()
        print("done", flush=True)
    elif mode == "forever":
        i = 0
        while True:
            tier.put(make_key(i), make_block(i, shape=(4, 2, 16, 4, 32)))
            i += 1
            if i % 16 == 0:
                tier.drain()
                print(f"committed {i}", flush=True)
    elif mode == "share":
        start, count, other = int(argv[3]), int(argv[4]), int(argv[5])
        for i in range(start, start + count):
            tier.put(make_key(i), make_block(i))
        tier.drain()
        print("written", flush=True)
        assert sys.stdin.readline().strip() == "check"
        seen = sum(same_bits(tier.get(make_key(i)), make_block(i)) for i in range(other, other + count))
        tier.close()
        print(f"seen {seen}", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
