"""Which backend gets a request: the longest cached prefix, weighed against load.

Knows: the cost of sending a request to a backend, in prompt tokens' worth of work,

    miss(b) = prompt_tokens - block_size * sum(weight[medium] of each block of b's prefix)
    cost(b) = miss(b) + queue_weight * pending(b) + in_flight_tokens * in_flight(b)

where a block on the device ("GPU") or in host memory ("CPU") is worth (nearly) a whole block
and one on disk or in the remote store less (it must still be read and decoded); pending(b) is
the prefill the router has queued there (the misses of its requests on b that have not started
answering), and every request in flight on b costs `in_flight_tokens` more (its decode steps). Dynamo's
KV router weighs overlap against active load the same way. queue_weight < 1 leans towards the
hit: waiting behind a queued prefill and computing the same prefill elsewhere take about as long,
but only the first leaves one copy of the prefix and the machine's work smaller. The cheapest
backend wins; ties go to the longer prefix, then the fewest in flight (a miss everywhere: the
least loaded), then the fewest routed so far, then list order.
A `sticky` backend (the one a request's prompt_cache_key sticks to: sticky.py) is credited the
whole prompt: its miss counts as 0 and it wins ties, but its load terms stay, so a sticky backend
loaded past another's whole miss plus load loses the request to the cost rule as any other would.
Doesn't know: where the prefixes come from (index.py) or HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from storage.tier_kinds import media, weights as default_weights     # each tier kind's own, read at each use


@dataclass(frozen=True, slots=True)
class Policy:
    in_flight_tokens: float = 64.0
    queue_weight: float = 0.5
    weights: dict[str, float] = field(default_factory=default_weights)    # by medium

    def __post_init__(self) -> None:
        if self.in_flight_tokens < 0:
            raise ValueError(f"in_flight_tokens: expected >= 0, got {self.in_flight_tokens}")
        if self.queue_weight < 0:
            raise ValueError(f"queue_weight: expected >= 0, got {self.queue_weight}")
        known = media()
        unknown = set(self.weights) - set(known)
        if unknown or set(known) - set(self.weights):
            raise ValueError(f"weights: expected one weight for each of {known}, got {sorted(self.weights)}")
        if any(not 0 <= w <= 1 for w in self.weights.values()):
            raise ValueError(f"weights: expected values in [0, 1], got {self.weights}")


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    in_flight: int
    routed: int = 0
    pending_tokens: int = 0      # prefill queued there: misses of requests not answering yet


@dataclass(frozen=True, slots=True)
class Choice:
    backend: str
    hit_tokens: int          # the prefix the chosen backend is predicted to hold, in tokens (unweighted)
    miss_tokens: int         # what it is predicted to compute (weighted by medium, as the cost counts it)
    cost: float


def choose(policy: Policy, candidates: list[Candidate], prefixes: dict[str, list[int]], prompt_tokens: int,
           block_size: int, sticky: str | None = None) -> Choice:
    """The cheapest candidate; `prefixes[name]` lists the medium rank (index into
    storage/tier_kinds.py's media(), index.py's rank_of) of each block of its cached prefix.
    `candidates` must not be empty."""
    if not candidates:
        raise ValueError("candidates: no backend to choose from")
    # A medium registered after this policy was made: its kind's own weight.
    weight = [policy.weights.get(m, w) for m, w in default_weights().items()]
    best: tuple | None = None
    for order, c in enumerate(candidates):
        ranks = prefixes.get(c.name, [])
        held = block_size * sum(weight[r] for r in ranks)
        miss = max(0.0, prompt_tokens - held)
        stuck = c.name == sticky
        cost = (0.0 if stuck else miss) + policy.queue_weight * c.pending_tokens + policy.in_flight_tokens * c.in_flight
        key = (cost, not stuck, -held, c.in_flight, c.routed, order)
        if best is None or key < best[0]:
            best = (key, Choice(c.name, len(ranks) * block_size, round(miss), cost))
    assert best is not None
    return best[1]
