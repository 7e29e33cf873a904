"""Compute or load: which of a matched prefix's blocks to recompute and which to restore.

Knows: the restore policy ("auto", "load", "recompute"), the two measured figures it decides
from -- each tier's restore time, a latency plus the bytes over a bandwidth
(storage/restore_rates.py: calibrated at start, then fitted to the loader's own fills), and this
engine's prefill time (engine/prefill_model.py: calibrated at start, then fitted to its own
prefill steps) -- and the split
rule. For a matched prefix of `n` blocks whose first `d` are on the device, it picks `s` in
[d, n]: blocks [d, s) are recomputed by chunked prefill from the front while blocks [s, n) are
loaded at the same time (the idea of Cake, "Compute Or Load KV Cache? Why Not Both?"), with
`s` minimizing the predicted max(compute(d..s), load(s..n)). `s = d` loads everything (today's
behaviour), `s = n` recomputes everything. A plan that loads joins before the suffix runs, in a
step of its own; recomputing everything runs the suffix in the prefix's chunks (the suffix's
length, when the caller gives it, is charged each way). A plan that loads must beat recomputing
everything by MIN_GAIN, and a split must beat loading everything by MIN_GAIN: a near-tie goes
to the recompute (no store in the request's path) over a load, and to the load over a split.
Doesn't know: pages, fills or sequences (the scheduler carries the split out), or billing (a
block the cache held is billed from the tier that held it whichever way it reached the pool).

A part's load time is per tier one latency plus its blocks' bytes over the bandwidth (a fill
reads a request's blocks of one tier together). Without a prefill figure "auto" loads ("no
figures"); with one but without a figure for a tier in the prefix it recomputes (a load of
unknown cost may be far slower than the miss, a recompute never is); the engine's calibration at start
(engine/calibration.py) gives both figures before the first request, so that happens only with
it turned off (CacheConfig.calibrate) or for a remote tier whose store did not answer the probe.

Runs on the engine thread (the scheduler's admission); the figures it reads are thread-safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from storage.config import RESTORE_POLICIES as POLICIES
from storage.tier_kinds import is_local     # a local tier's fills run on the loader's fill pool, one after another
# A split must beat loading everything by this fraction: recomputing takes engine steps every
# running request shares, a load runs on the loader's threads, so a near-tie goes to the load.
# And any plan that loads must beat recomputing everything by it: a load's time is a prediction
# of a store and a link (a stall, a slower day), a recompute's is the engine's own, so a
# near-tie goes to the recompute (issue 27 run 7: 5 Mbit/s, 2048 tokens, a split a few percent
# ahead of recomputing took 1.05-1.2x it).
MIN_GAIN = 0.10


class Rates(Protocol):
    def seconds(self, tier: str, nblocks: int, block_bytes: int) -> float | None: ...


class Prefill(Protocol):
    def predict(self, new_tokens: int, context: int) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Split:
    """The plan for one matched prefix: blocks [device, start) recomputed, [start, n) loaded."""
    device: int                  # d: leading blocks already on the device
    start: int                   # s
    n: int                       # matched blocks
    compute_s: float | None      # predicted time of the recomputed part (None: no figure)
    load_s: float | None         # predicted time of the loaded part
    reason: str                  # "policy", "no figures", "predicted"

    @property
    def recomputed(self) -> int:
        return self.start - self.device

    @property
    def loaded(self) -> bool:
        return self.start < self.n


class RestorePlanner:
    def __init__(self, policy: str, rates: Rates, prefill: Prefill, block_bytes: int, block_size: int,
                 chunk_tokens: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"restore_policy: expected one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.rates = rates
        self.prefill = prefill
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens      # the scheduler's per-step budget: prefill goes in chunks
        self.decisions = {"load": 0, "recompute": 0, "split": 0}   # engine thread only
        self.reasons = {"policy": 0, "no figures": 0, "predicted": 0}

    def split(self, tiers: Sequence[str], suffix_tokens: int = 0) -> Split:
        """The split for a matched prefix whose blocks are held in `tiers` (prefix order), before
        `suffix_tokens` tokens of the prompt no tier holds (0: the suffix left out). A plan that
        loads joins before the suffix runs, in a step of its own; recomputing everything runs the
        suffix in the prefix's chunks, so it is charged the suffix within them (run 6 of issue 27:
        a 32-token back over a 30 Mbit link cost a 256-token prompt one more step than the miss)."""
        n = len(tiers)
        d = next((i for i, t in enumerate(tiers) if t != "device"), n)
        if self.policy == "load" or d == n:
            return self._decided(Split(d, d, n, None, None, "policy"))
        if self.policy == "recompute":
            return self._decided(Split(d, n, n, None, None, "policy"))
        costs = self._load_costs(tiers)
        if self.compute_seconds(d, d + 1) is None:
            return self._decided(Split(d, d, n, None, None, "no figures"))
        if costs is None:
            # The compute has a figure and a tier does not (a remote store whose link probe has
            # not answered yet): a load of unknown cost could take far longer than the miss it
            # replaces (a first hit over a 30 Mbit link took 5.7x its miss), a recompute cannot.
            return self._decided(Split(d, n, n, self.compute_seconds(d, n), None, "no figures"))
        load_all = self._load_seconds(costs, d, n)
        # compute(d..s) grows with s and load(s..n) shrinks: the best max is where they cross.
        lo, hi = d, n
        while lo < hi:        # the first s whose compute reaches its load
            mid = (lo + hi) // 2
            if self.compute_seconds(d, mid) >= self._load_seconds(costs, mid, n):
                hi = mid
            else:
                lo = mid + 1
        # (finish, s, compute, load) of the two splits beside the crossing: the earlier finish,
        # a tie to the smaller s (less engine time).
        candidates = []
        for s in (lo - 1, lo):
            if d <= s <= n:
                c, ld = self.compute_seconds(d, s), self._load_seconds(costs, s, n)
                candidates.append((max(c, ld), s, c, ld))
        finish, best, compute, load = min(candidates)
        if best == d or finish > load_all * (1 - MIN_GAIN):
            plan = Split(d, d, n, 0.0, load_all, "predicted")
            finish = load_all
        else:
            plan = Split(d, best, n, compute, load, "predicted")
        if plan.loaded:
            # The whole prompt computed (prefix and suffix in the scheduler's chunks) against this
            # plan and then the suffix's own step after the join: the plan must win by MIN_GAIN.
            whole = self._tokens_seconds(d * self.block_size, n * self.block_size + suffix_tokens)
            after = self._tokens_seconds(n * self.block_size, n * self.block_size + suffix_tokens)
            if whole is not None and after is not None and finish + after > whole * (1 - MIN_GAIN):
                return self._decided(Split(d, n, n, self.compute_seconds(d, n), None, "predicted"))
        return self._decided(plan)

    def compute_seconds(self, start: int, end: int) -> float | None:
        """Predicted time to prefill blocks [start, end) in the scheduler's chunks."""
        return self._tokens_seconds(start * self.block_size, end * self.block_size)

    def _tokens_seconds(self, pos: int, stop: int) -> float | None:
        """Predicted time to prefill tokens [pos, stop) in the scheduler's chunks."""
        if stop <= pos:
            return 0.0
        total = 0.0
        while pos < stop:
            chunk = min(self.chunk_tokens, stop - pos)
            t = self.prefill.predict(chunk, pos + chunk)
            if t is None:
                return None
            total, pos = total + t, pos + chunk
        return total

    def load_seconds(self, tiers: Sequence[str]) -> float | None:
        """Predicted time to load blocks held in `tiers` (prefix order), or None when one of
        the tiers has no figure yet."""
        costs = self._load_costs(tiers)
        return None if costs is None else self._load_seconds(costs, 0, len(costs))

    def round_trip_seconds(self, tier: str) -> float | None:
        """One call's latency to `tier`, its bytes aside (a probe's round trip), or None
        without a figure."""
        seconds = getattr(self.rates, "seconds", None)
        return None if seconds is None else seconds(tier, 1, 0)

    def _load_costs(self, tiers: Sequence[str]) -> list[str] | None:
        """The prefix's tiers, or None when a tier below the device in it has no figure yet."""
        for t in set(tiers) - {"device"}:
            if self._tier_seconds(t, 1) is None:
                return None
        return list(tiers)

    def _tier_seconds(self, tier: str, nblocks: int) -> float | None:
        seconds = getattr(self.rates, "seconds", None)
        if seconds is not None:
            return seconds(tier, nblocks, self.block_bytes)
        rate = self.rates.get(tier)          # a rates object with one figure (bytes/s) per tier
        return None if not rate else nblocks * self.block_bytes / rate

    def _load_seconds(self, costs: list[str], start: int, end: int) -> float:
        """Predicted time to load blocks [start, end): per tier one fill (a latency, then the
        bytes). Host and disk fills run one after another on a fill worker; linked fills run on
        their own pool at the same time (storage/loader.py), so the slower of the two."""
        counts: dict[str, int] = {}
        for t in costs[start:end]:
            if t != "device":
                counts[t] = counts.get(t, 0) + 1
        local = sum(self._tier_seconds(t, k) or 0.0 for t, k in counts.items() if is_local(t))
        linked = sum(self._tier_seconds(t, k) or 0.0 for t, k in counts.items() if not is_local(t))
        return max(local, linked)

    def _decided(self, split: Split) -> Split:
        kind = "load" if split.start == split.device else "recompute" if split.start == split.n else "split"
        if split.device < split.n:
            self.decisions[kind] += 1
            self.reasons[split.reason] += 1
        return split

    def snapshot(self) -> dict:
        return {"policy": self.policy, "decisions": dict(self.decisions), "reasons": dict(self.reasons),
                "min_gain": MIN_GAIN}
