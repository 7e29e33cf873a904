"""What a tier is, said once: the kinds of tier the house knows, each described by itself, and the
one list of them (`TIERS`, fastest first) every other list of tiers is read from.

Knows: per kind its name (in stats, billing, metrics, the CLI and HTTP usage), its KV-event medium
(vLLM's wire name: "GPU", "CPU", "DISK", ...), whether it is this process's own (`local`) or a
store shared over a link, its price key (`Prices`' `<name>_hit`), what a block held there is
worth to the router (`weight`), how its restore rate is first measured (`calibrates`), and how its
status reads outside the cache (`health`: its /ready state and fields, its own /metrics series, its
lines under `tieredkv status`: storage/tier_health.py; the disk's and the store's said in their
rooms, storage/disk/health.py, storage/remote/health.py). A tier below the host is built by
storage/tier_wiring.py and carries its kind (`LowerTier.kind`); `register` adds one (a test's, a
new room's) to the list.
Doesn't know: any tier's storage or code: nothing heavy is imported, so the router (another
process, without the engine's wiring) derives its media and weights from the same list.

Threads: `register` is called at import or set-up time, before a cache, router or engine is
built; the list is read, never written, while they run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from storage.disk.health import DiskHealth
from storage.remote.health import RemoteHealth
from storage.tier_health import AlwaysReady, TierHealth


@dataclass(frozen=True)
class TierKind:
    name: str                  # "disk": in stats, billing, metrics, the CLI and HTTP usage
    medium: str                # its KV events' medium (vLLM's name for where a block is)
    local: bool                # this process's own (read on the fill pool, known without a probe);
                               # False: a store shared over a link (probed, never dropped from here)
    weight: float              # what a block held here is worth to the router: 1.0 = on the device
    calibrates: str = "none"   # its first restore figure: "copy" (host copies), "read" (a block's
                               # decode), "link" (the link probed: LowerTier.link_probe), "none"
    health: TierHealth = field(default_factory=TierHealth, compare=False)   # how its status reads
                               # in /ready, /metrics and `tieredkv status` (storage/tier_health.py)

    @property
    def price_key(self) -> str:
        """Its hit price's name in Prices (engine/billing_prices.py) and a prices file."""
        return f"{self.name}_hit"

    @property
    def loads(self) -> bool:
        """A hit here is read into a device page (every tier but the device itself)."""
        return self is not DEVICE


DEVICE = TierKind("device", "GPU", local=True, weight=1.0, health=AlwaysReady())
HOST = TierKind("host", "CPU", local=True, weight=0.9, calibrates="copy")
DISK = TierKind("disk", "DISK", local=True, weight=0.5, calibrates="read", health=DiskHealth())
REMOTE = TierKind("remote", "REMOTE", local=False, weight=0.3, calibrates="link", health=RemoteHealth())

_KINDS: list[TierKind] = [DEVICE, HOST, DISK, REMOTE]      # fastest first


class TierNames(Sequence[str]):
    """The registered kinds' names, fastest first, read live: a kind registered later is in it.
    Compares and prints as the tuple it holds now."""

    def __getitem__(self, i):
        return tuple(k.name for k in _KINDS)[i]

    def __len__(self) -> int:
        return len(_KINDS)

    def __iter__(self) -> Iterator[str]:
        return iter([k.name for k in _KINDS])

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, TierNames)) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


TIERS = TierNames()


def register(kind: TierKind, after: str | None = None) -> TierKind:
    """Add a kind to the list: after the kind named `after` (how fast it is), else last. Its name
    and medium are its own; registering the same kind again is a no-op."""
    if kind in _KINDS:
        return kind
    if any(k.name == kind.name or k.medium == kind.medium for k in _KINDS):
        raise ValueError(f"tier kind {kind.name!r}: its name or medium {kind.medium!r} is taken")
    at = len(_KINDS) if after is None else [k.name for k in _KINDS].index(after) + 1
    _KINDS.insert(at, kind)
    return kind


def unregister(kind: TierKind) -> None:
    """Take a registered kind off the list (a test's own, when it ends)."""
    if kind in (DEVICE, HOST, DISK, REMOTE):
        raise ValueError(f"tier kind {kind.name!r} is the house's own")
    if kind in _KINDS:
        _KINDS.remove(kind)


def kinds() -> tuple[TierKind, ...]:
    return tuple(_KINDS)


def kind_of(name: str) -> TierKind:
    """The kind called `name` (ValueError naming the known ones, else)."""
    for k in _KINDS:
        if k.name == name:
            return k
    raise ValueError(f"tier: expected one of {tuple(TIERS)}, got {name!r}")


def media() -> tuple[str, ...]:
    """The KV-event media, fastest first (the router ranks a block by its medium's place here)."""
    return tuple(k.medium for k in _KINDS)


def medium_ranks() -> dict[str, int]:
    """Each medium's place in media() (0: the device), read live: the router's ranks."""
    return {k.medium: i for i, k in enumerate(_KINDS)}


def weights() -> dict[str, float]:
    """Each medium's router weight (what a block held there is worth), read live."""
    return {k.medium: k.weight for k in _KINDS}


def medium_of(name: str) -> str:
    return kind_of(name).medium


def is_local(name: str) -> bool:
    return kind_of(name).local
