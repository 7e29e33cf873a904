"""What a verify of a tier below the host found: `tieredkv verify` on the disk tier
(storage/disk/integrity.py) and on the remote store (storage/remote/inspect.py) answer the same
report, each leaving the fields of the other's kind at their defaults.

Knows: the report's shape. Doesn't know: how a block is checked (codec/stored_block.py) or how a
tier walks its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DamagedBlock:
    key: bytes          # where the tier keeps it: the disk's block hash, the store's tkv:r2:<ns>:<hash> key
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int                      # blocks read and checked
    damaged: tuple[DamagedBlock, ...]
    repaired: int                     # damaged blocks deleted
    # The disk: what is wrong with the store as a whole, beyond its blocks: a page the walk
    # refused (storage/disk/pagewalk.py: trees, overflow headers, the free-page lists), counters
    # or an LRU index that disagree with the blocks (audit). Empty when sound.
    store: tuple[str, ...] = ()
    # The disk: what --repair did about `store`: counters recounted / the LRU index rebuilt, or
    # the damaged store moved aside (a fresh one in its place). Empty without repair.
    store_repaired: tuple[str, ...] = ()
    vanished: int = 0                 # the remote: keys gone between SCAN and GET (evicted, expired)
    errors: int = 0                   # the remote: values the store did not give (an error reply)
    foreign: int = 0                  # the remote: values sealed under another fleet secret (left alone)
