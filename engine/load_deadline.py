"""Load deadlines: how long a request waits for the blocks it loads before computing them itself.

Knows: the rule. A load planned at time t (a load-only plan, or the back part of a compute-or-load
split) has its deadline at

    t + min(margin x compute(blocks it brings), LOAD_MARGIN x load(those blocks)) + slack

where compute() is the predicted time to prefill those blocks in the scheduler's chunks
(RestorePlanner.compute_seconds over the engine's prefill model) -- when recomputing them would
have finished -- and load() the predicted time to load them from their tiers (the restore
rates: a latency, then the bytes); `margin` (>= 1) covers the prediction's error and `slack` a
scheduling hiccup (CacheConfig.load_deadline_margin, load_deadline_slack_s). A load from the
shared store running LOAD_MARGIN times longer than the link's figures say is not a slow load but
a sick store (a local disk or host load is bounded by the recompute alone): it is given up then, not at the full recompute, so a stall costs its request LOAD_MARGIN x a load it
was planned for (cheaper than the recompute, or the planner would not have loaded) on top of
computing what did not arrive. Before the prefill model has a figure, the predicted compute is
`fallback_s`: the remote store's per-call timeout (CacheConfig.remote_timeout_s).
The deadline is re-derived at every check from the figures as they stand then (`due`, from the
`PlannedLoad` kept when the load was planned): a figure corrected while the load runs -- the
start's calibration rescaled by the first real prefill steps, a split's own front among them
(engine/prefill_model.py) -- moves the deadline with it, so a load planned from a figure 10x too
pessimistic is not waited for 10x too long.
A request's wait for its remote probe (which blocks the shared store holds, asked at submit) is
bounded by what a probe is, one round trip of the store, not by the load of the blocks' bytes:

    min(LOAD_MARGIN x round_trip(the slowest linked tier), PROBE_FRACTION x compute(all blocks)) + probe_slack

(`probe_seconds`; the round trip is the remote tier's latency figure: the link probe's at start,
then fitted to its fills; without one, the fraction of the recompute alone; `probe_slack` a
remote worker at nice +10 woken on a busy machine: CacheConfig.probe_wait_slack_s, 0.02 s, not
the load's slack, which on a ~0.3 s miss was most of what a stalled store cost). Past it the request
computes from the front and a late answer still loads the rest from the back
(engine/probe_wait.py), so a stalled store costs a request at most that small fraction of its
miss on top of the miss. A stalled load costs at most about one recompute plus the margin, and usually
far less (SGLang HiCache's "timeout" prefetch policy; Cake's compute-or-load split, revised at
runtime). The late fills end on their own pages, and their times teach the rates.
Doesn't know: clocks (the scheduler owns one, injectable, and checks deadlines in schedule(), so
the engine thread never waits for a load), pages or fills (storage/load_outcome.py keeps what
arrived), or billing (a block that did not arrive is billed as computed).

Engine thread only; the figures it reads are thread-safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from storage.tier_kinds import is_local, kinds

# A load from the shared store this many times slower than its figures predict is given up (see
# above). Loads from this machine's own tiers are bounded by the recompute alone: their figures
# come from a codec decode and warm page cache (a cold read on a busy machine takes several times
# that, and is still far quicker than recomputing), and no network stands between them.
LOAD_MARGIN = 3.0
# A probe's wait (see above): LOAD_MARGIN round trips, never more than this fraction of the
# predicted recompute of the request's blocks (what a stalled store may add to its miss), + slack.
PROBE_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class PlannedLoad:
    """A load of blocks [start, end) of a prompt, held in `tiers`, planned at `at` (the
    scheduler's clock): what its deadline is derived from, whenever it is checked."""
    at: float
    start: int
    end: int
    tiers: tuple[str, ...]


def planned_load(deadlines: "LoadDeadlines | None", clock: Callable[[], float], start: int, end: int,
                 tiers: Sequence[str]) -> PlannedLoad | None:
    """A load of blocks [start, end) of a prompt (held in `tiers`), planned now on `clock`: its
    deadline is derived from it at each check (LoadDeadlines.due). None: no deadlines."""
    return None if deadlines is None else PlannedLoad(clock(), start, end, tuple(tiers))


@dataclass(frozen=True, slots=True)
class LoadDeadlines:
    compute_seconds: Callable[[int, int], float | None]   # predicted prefill of blocks [start, end)
    margin: float = 1.25
    slack_s: float = 0.1
    fallback_s: float = 0.5           # the predicted time while there is no prefill figure
    # Predicted load time of blocks held in these tiers (RestorePlanner.load_seconds; None: no
    # figure for one of them). None: deadlines from the compute alone.
    load_seconds: Callable[[Sequence[str]], float | None] | None = None
    # A call's round trip to a tier, bytes aside (RestorePlanner.round_trip_seconds; None: no
    # figure). None: a probe's wait from the compute alone.
    round_trip_s: Callable[[str], float | None] | None = None
    probe_slack_s: float = 0.02       # CacheConfig.probe_wait_slack_s

    def __post_init__(self) -> None:
        for name, low in (("margin", 1.0), ("slack_s", 0.0), ("fallback_s", 0.0), ("probe_slack_s", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
                raise ValueError(f"{name}: expected a number >= {low}, got {v!r}")

    def seconds(self, start: int, end: int, tiers: Sequence[str] = ()) -> float:
        """How long after it is planned a load of blocks [start, end) of a prompt, held in
        `tiers` (one per block; "device" ones cost nothing), may take."""
        predicted = self.compute_seconds(start, end)
        bound = self.margin * (self.fallback_s if predicted is None else predicted)
        return min(bound, self._load_bound(tiers)) + self.slack_s

    def due(self, load: PlannedLoad) -> float:
        """When `load` stops being waited for, from the figures as they stand now."""
        return load.at + self.seconds(load.start, load.end, load.tiers)

    def probe_seconds(self, blocks: int) -> float:
        """How long a request of `blocks` full blocks waits for its remote probe (a round trip
        of the store) before it is admitted without the store's answer (see above)."""
        predicted = self.compute_seconds(0, blocks)
        bound = PROBE_FRACTION * (self.fallback_s if predicted is None else predicted)
        rtts = [] if self.round_trip_s is None else [self.round_trip_s(k.name) for k in kinds() if not k.local]
        rtt = max((r for r in rtts if r is not None), default=None)     # the slowest link a probe asks
        return (bound if rtt is None else min(bound, LOAD_MARGIN * rtt)) + self.probe_slack_s

    def _load_bound(self, tiers: Sequence[str]) -> float:
        loading = [t for t in tiers if t != "device"]
        if not loading or self.load_seconds is None or all(is_local(t) for t in loading):
            return float("inf")
        predicted = self.load_seconds(loading)
        return float("inf") if predicted is None else LOAD_MARGIN * predicted

    def snapshot(self) -> dict:
        return {"margin": self.margin, "load_margin": LOAD_MARGIN, "slack_s": self.slack_s,
                "fallback_s": self.fallback_s, "probe_slack_s": self.probe_slack_s, "probe_fraction": PROBE_FRACTION}
