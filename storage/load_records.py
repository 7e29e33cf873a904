"""What a load and a prefetch are, as the cache, the loader and the scheduler share them.

Knows: a `Fill` (one device page being filled with one block: where it is read, the tier it is
billed from, whether it ended well, the loads waiting for it, the cancellable read it is part of),
a `Load` (one request's planned prefix: its pages, each block's billed tier and token count, the
fill each waits for), a `Prefetch` (a request's disk -> host chunks, nothing else: what they moved
is told to the request's own hit account, storage/hit_account.py), a `ChainProbe` (which blocks of
a request's chain the tiers over a link hold: a `ProbeAnswer` per tier). Doesn't know: who fills
them or when (storage/loader.py), nor what a load ends with (storage/load_outcome.py).

Threads: a Fill's `done` and a probe's `done` are set once by the worker that ran them, after the
fields they vouch for are written; everything else is written under the tiers' lock (each field
says which).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

from storage.cancellation import Cancellation
from storage.hashing import BlockKey


@dataclass(eq=False)
class Fill:
    """One device page being filled with one block. `ok` is meaningful once `done` is set.
    `read_from` is the tier its bytes are read from; `billed_tier` the one it is billed from (HitAccount.tier_of
    of the request that planned it: the disk for a block its own prefetch moved into the host): set
    once, when the fill is planned, and what every request waiting for it is billed and the
    promotion is counted by."""
    key: BlockKey
    page: int
    read_from: str                                # "host" or a tier below's name, when planned
    billed_tier: str = ""                         # "" means read_from
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    waiters: int = 0                              # loads waiting for it (under the tiers' lock)
    task: "_Task | None" = None                   # the read it is part of, when it can be cancelled

    def __post_init__(self) -> None:
        self.billed_tier = self.billed_tier or self.read_from

    @property
    def given_up(self) -> bool:
        """Its read was cancelled (under the tiers' lock): no new load may wait for it."""
        return self.task is not None and self.task.given_up


@dataclass(eq=False)
class _Task:
    """The fills one worker reads together (one plan's fills over a link) and how their read is
    stopped. `given_up` is set under the tiers' lock, before `cancel` is cancelled."""
    fills: list[Fill]
    cancel: Cancellation = field(default_factory=Cancellation)
    given_up: bool = False


@dataclass(eq=False)
class Load:
    """One request's planned prefix: the pages it holds (prefix order), the tier each block is
    billed from, and the fill each page waits for (None: a device hit, ready now)."""
    pages: list[int]
    tiers: list[str]
    fills: list[Fill | None]
    tokens: list[int]                             # each block's tokens (an exact entry's tail: fewer; logits: 0)
    started: float = field(default_factory=time.perf_counter)

    def ready(self) -> bool:
        return all(f is None or f.done.is_set() for f in self.fills)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self.fills:
            if f is not None and not f.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    @property
    def pending(self) -> bool:
        return any(f is not None for f in self.fills)


@dataclass(eq=False)
class _Chunk:
    """Blocks one prefetch task reads together. `started` (under the tiers' lock): past this
    point a fill waits for `done` instead of claiming the block."""
    keys: list[BlockKey]
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class ProbeAnswer:
    """What each tier over a link answered a probe, on its own: per tier name, the hashes of the
    chain's blocks it holds. Never merged: a block only the second tier holds is that tier's."""
    held: Mapping[str, frozenset[bytes]] = field(default_factory=dict)

    def holds(self, tier: str, block: bytes) -> bool:
        return block in self.held.get(tier, ())

    def __bool__(self) -> bool:
        return any(self.held.values())


@dataclass(eq=False)
class ChainProbe:
    """Which blocks of a request's chain (after its last local one) the tiers over a link hold,
    asked on a loader thread at submit (TieredKVCache.probe). `answer` is written once by the
    probing thread, before `done` is set; read only after."""
    answer: ProbeAnswer = ProbeAnswer()
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


@dataclass(eq=False)
class Prefetch:
    """A request's disk -> host prefetch: its chunks (storage/prefetch.py). What they bring into
    the host tier is told to the request's hit account, handed beside it (HitAccount.moved_up)."""
    chunks: list[_Chunk] = field(default_factory=list)

    def wait(self, timeout: float | None = None) -> bool:
        return all(c.done.wait(timeout) for c in self.chunks)
