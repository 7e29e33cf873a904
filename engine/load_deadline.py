"""Load deadlines: how long a request waits for the blocks it loads before computing them itself.

Knows: the rule. A load planned at time t (a load-only plan, or the back part of a compute-or-load
split) has its deadline at

    t + margin x compute(blocks it brings) + slack

where compute() is the predicted time to prefill those blocks in the scheduler's chunks
(RestorePlanner.compute_seconds over the engine's prefill model) -- when recomputing them would
have finished -- `margin` (>= 1) covers the prediction's error and `slack` a scheduling hiccup
(CacheConfig.load_deadline_margin, load_deadline_slack_s). Before the prefill model has a
figure, the predicted time is `fallback_s`: the remote store's per-call timeout
(CacheConfig.remote_timeout_s), the longest a single read of the slowest tier is allowed to take.
A stalled store thus costs a request at most about one recompute plus the margin, after which it
computes what did not arrive (SGLang HiCache's "timeout" prefetch policy; Cake's compute-or-load
split, revised at runtime).
Doesn't know: clocks (the scheduler owns one, injectable, and checks deadlines in schedule(), so
the engine thread never waits for a load), pages or fills (storage/load_outcome.py keeps what
arrived), or billing (a block that did not arrive is billed as computed).

Engine thread only; the figures it reads are thread-safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class LoadDeadlines:
    compute_seconds: Callable[[int, int], float | None]   # predicted prefill of blocks [start, end)
    margin: float = 1.25
    slack_s: float = 0.1
    fallback_s: float = 0.5           # the predicted time while there is no prefill figure

    def __post_init__(self) -> None:
        for name, low in (("margin", 1.0), ("slack_s", 0.0), ("fallback_s", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
                raise ValueError(f"{name}: expected a number >= {low}, got {v!r}")

    def seconds(self, start: int, end: int) -> float:
        """How long after it is planned a load of blocks [start, end) of a prompt may take."""
        predicted = self.compute_seconds(start, end)
        return self.margin * (self.fallback_s if predicted is None else predicted) + self.slack_s

    def snapshot(self) -> dict:
        return {"margin": self.margin, "slack_s": self.slack_s, "fallback_s": self.fallback_s}
