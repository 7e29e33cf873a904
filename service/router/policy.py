"""Which backend gets a request: the longest cached prefix, weighed against load.

Knows: the cost of sending a request to a backend, in prompt tokens' worth of work,

    cost(b) = prompt_tokens - block_size * sum(weight[medium] of each block of b's prefix)
              + load_tokens * in_flight(b)

where a block on the device ("GPU") or in host memory ("CPU") is worth (nearly) a whole block
and one on disk or in the remote store less (it must still be read and decoded), and every
request the router has in flight on b costs `load_tokens` (Dynamo's KV router weighs overlap
against active load the same way). The cheapest backend wins; ties (a miss everywhere is one)
go to the backend with the fewest in flight, then the fewest routed so far, then list order.
Doesn't know: where the prefixes come from (index.py) or HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from service.router.events import MEDIA

DEFAULT_WEIGHTS = {"GPU": 1.0, "CPU": 0.9, "DISK": 0.5, "REMOTE": 0.3}


@dataclass(frozen=True, slots=True)
class Policy:
    load_tokens: float = 256.0
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))

    def __post_init__(self) -> None:
        if self.load_tokens < 0:
            raise ValueError(f"load_tokens: expected >= 0, got {self.load_tokens}")
        unknown = set(self.weights) - set(MEDIA)
        if unknown or set(MEDIA) - set(self.weights):
            raise ValueError(f"weights: expected one weight for each of {MEDIA}, got {sorted(self.weights)}")
        if any(not 0 <= w <= 1 for w in self.weights.values()):
            raise ValueError(f"weights: expected values in [0, 1], got {self.weights}")


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    in_flight: int
    routed: int = 0


@dataclass(frozen=True, slots=True)
class Choice:
    backend: str
    hit_tokens: int          # the prefix the chosen backend is predicted to hold, in tokens (unweighted)
    cost: float


def choose(policy: Policy, candidates: list[Candidate], prefixes: dict[str, list[int]], prompt_tokens: int,
           block_size: int) -> Choice:
    """The cheapest candidate; `prefixes[name]` lists the medium rank (index into MEDIA) of each
    block of its cached prefix. `candidates` must not be empty."""
    if not candidates:
        raise ValueError("candidates: no backend to choose from")
    weight = [policy.weights[m] for m in MEDIA]
    best: tuple | None = None
    for order, c in enumerate(candidates):
        ranks = prefixes.get(c.name, [])
        cost = prompt_tokens - block_size * sum(weight[r] for r in ranks) + policy.load_tokens * c.in_flight
        key = (cost, c.in_flight, c.routed, order)
        if best is None or key < best[0]:
            best = (key, Choice(c.name, len(ranks) * block_size, cost))
    assert best is not None
    return best[1]
