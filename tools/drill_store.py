"""The fault drill's store: the blocks it puts (key and bytes by index, fixed shape and namespace),
the capacities it uses, how it fills an attacked store so eviction has run, and a one-shot child
process. Knows nothing of attacks, trials or their tally (tools/fault_drill.py and its drill_*
siblings); the drill's child scripts import make_key/make_block from here (tools/ on their path).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from storage.disk.tier import DiskTier  # noqa: E402
from storage.hashing import BlockKey, hash_block, root_hash  # noqa: E402

NAMESPACE = b"\x07" * 32
SHAPE = (2, 2, 16, 3, 8)
CAP = 256 << 20
SMALL_CAP = 1 << 20          # the page-flip store's capacity: eviction runs
FRESH_BYTES = 1200 << 10     # new blocks each trial puts (past the capacity: evictions)


def make_key(i: int) -> BlockKey:
    parent = root_hash(NAMESPACE)
    tokens = tuple(range(16 * i, 16 * i + 16))
    return BlockKey(hash_block(parent, tokens), parent, tokens, NAMESPACE)


def make_block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int32), b.view(torch.int32))


def child(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def populate_evicting(path: str | Path, blocks: int, capacity: int = SMALL_CAP) -> list[int]:
    """Put `blocks` blocks into a store of `capacity`, the first three quarters at twice the
    capacity (the drop to `capacity` then frees many pages at once: the free-page database
    grows a branch page), with reads between batches (the `lru` database churns). Returns the
    indices stored at the end."""
    quiet = logging.getLogger("storage.disk")
    level, quiet.level = quiet.level, logging.ERROR      # the capacity change is warned about
    try:
        first = blocks * 3 // 4
        with DiskTier(str(path), 2 * capacity) as t:
            for i in range(first):
                t.put(make_key(i), make_block(i))
                if i % 50 == 49:
                    t.drain()
                    for j in range(i - 40, i, 3):
                        t.get(make_key(j))
        with DiskTier(str(path), capacity) as t:
            for i in range(first, blocks):
                t.put(make_key(i), make_block(i))
            t.drain()
            for j in range(max(0, first - 100), first, 2):
                t.get(make_key(j))
            t.drain()
            return [i for i in range(blocks) if t.contains(make_key(i))]
    finally:
        quiet.level = level
