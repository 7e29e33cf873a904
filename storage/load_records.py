"""What a load and a prefetch are, as the cache, the loader and the scheduler share them.

Knows: a `Fill` (one device page being filled with one block: where it is read, the tier it is
billed from, whether it ended well, the loads waiting for it, the cancellable read it is part of),
a `Load` (one request's planned prefix: its pages, each block's billed tier and token count, the
fill each waits for), a `Prefetch` (a request's disk -> host chunks, the hit account it tells what
it moved, its `RemoteProbe`). Doesn't know: who fills them or when (storage/loader.py), nor what a load ends
with (storage/load_outcome.py).

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
from storage.hit_account import HitAccount


@dataclass(eq=False)
class Fill:
    """One device page being filled with one block. `ok` is meaningful once `done` is set.
    `read_from` is the tier its bytes are read from; `billed_tier` the one it is billed from (HitAccount.tier_of
    of the request that planned it: the disk for a block its own prefetch moved into the host): set
    once, when the fill is planned, and what every request waiting for it is billed and the
    promotion is counted by."""
    key: BlockKey
    page: int
    read_from: str                                # "host", "disk" or "remote" when planned
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
    """The fills one worker reads together (one plan's remote fills) and how their read is
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
class RemoteProbe:
    """Which blocks of a request's chain (after its last local one) the tiers over a link hold.
    `answer` is written once by the probing thread, before `done` is set; read only after."""
    answer: ProbeAnswer = ProbeAnswer()
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Prefetch:
    """A request's disk -> host prefetch. What it brought into the host tier goes to the request's
    hit account (`hits`, storage/hit_account.py: HitAccount.moved_up, under the tiers' lock), which
    bills those blocks from the tier they were read from (the disk). `probe`: its remote probe, if
    one was started (the scheduler admits the request once it is done)."""
    chunks: list[_Chunk] = field(default_factory=list)
    hits: HitAccount = field(default_factory=HitAccount)
    probe: RemoteProbe | None = None

    @property
    def moved(self) -> set[bytes]:
        """The hashes this prefetch moved into the host tier (read under the tiers' lock, or once done)."""
        return set(self.hits.moved)

    def wait(self, timeout: float | None = None) -> bool:
        ok = all(c.done.wait(timeout) for c in self.chunks)
        return ok and (self.probe is None or self.probe.done.wait(timeout))

    def remote_pending(self) -> bool:
        return self.probe is not None and not self.probe.done.is_set()

    def remote_hashes(self) -> ProbeAnswer | None:
        return None if self.probe is None else self.probe.answer
