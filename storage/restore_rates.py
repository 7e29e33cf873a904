"""How long each tier below the device takes to restore blocks into the paged pool, as measured here.

Knows: per tier below the device (storage/tier_kinds.py) a restore time of `latency_s + nbytes / bytes_per_s`
(a 16-token hit over a 20 ms link is latency-bound; a long prefix is bandwidth-bound), fitted by
weighted least squares with non-negative terms over the tier's last WINDOW fills (the loader's
own: bytes made usable in pages over the fill's time -- read, verify, decode and copy), recent
fills weighing most, and the calibration's points at start: host, a copy of one block and of
four; a local tier below (the disk), its codec's decode of one block (latency 0: a page-cache
hit's bound); a linked tier (the remote store), the store itself (storage/remote/link_probe.py: a round trip and a block-sized read). The
calibration keeps a small weight afterwards, so fills all of one size still split into latency
and bandwidth. Also the last ERRORS (predicted, observed) pairs per tier: each fill's time as
the figures predicted it just before it was measured.
Doesn't know: what the figures are used for (engine/restore_planner.py decides from them;
cache_status's `cost_model`, /metrics and `tieredkv status` show them).

Thread-safe: fills finish on loader workers while status is read from anywhere.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

import torch

from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding
from storage.layout import BlockLayout

ALPHA = 0.2             # a fill's weight falls by this fraction with each newer fill
WINDOW = 32             # fills kept per tier for the fit
ANCHOR_WEIGHT = 0.05    # a calibration point's weight once fills are measured (the newest fill's is 1)
ERRORS = 16             # (predicted, observed) pairs kept per tier
MIN_SECONDS = 1e-7      # a bandwidth term never makes a byte free
CALIBRATION_REPEATS = 5 # each calibration copy timed this many times, the best kept


@dataclass(slots=True)
class Rate:
    """A tier's figures (under RestoreRates' lock)."""
    latency_s: float
    s_per_byte: float
    samples: int = 0                      # fills measured (0: the calibration's figures)
    source: str = "calibration"           # "calibration", "link probe" or "measured"
    anchors: list[tuple[float, float]] = field(default_factory=list)      # calibration (bytes, s)
    fills: deque = field(default_factory=lambda: deque(maxlen=WINDOW))     # (bytes, s), newest last
    errors: deque = field(default_factory=lambda: deque(maxlen=ERRORS))    # (predicted s, observed s)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.s_per_byte

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / max(self.s_per_byte, 1e-15)


class RestoreRates:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, Rate] = {}

    def seed(self, tier: str, bytes_per_s: float, latency_s: float = 0.0, source: str = "calibration",
             points: list[tuple[float, float]] | None = None) -> None:
        """A tier's figures before its first fill (a second seed changes nothing). `points`:
        the (bytes, seconds) measured, kept as the fit's anchors."""
        if bytes_per_s <= 0 or latency_s < 0:
            return
        with self._lock:
            if tier in self._rates:
                return
            anchors = list(points) if points else [(1.0, latency_s + 1.0 / bytes_per_s)]
            self._rates[tier] = Rate(latency_s, 1.0 / bytes_per_s, 0, source, anchors)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """One fill of `tier`: `nbytes` restored into pages in `seconds`."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            r = self._rates.get(tier)
            if r is None:
                r = self._rates[tier] = Rate(0.0, seconds / nbytes, 0, "measured")
            else:
                r.errors.append((r.seconds(nbytes), seconds))
            r.fills.append((float(nbytes), seconds))
            r.samples += 1
            r.source = "measured"
            r.latency_s, r.s_per_byte = _fit(r.fills, r.anchors)

    def get(self, tier: str, nbytes: float | None = None) -> float | None:
        """The effective bytes/s of a restore of `nbytes` (latency included); by default of a
        typical fill (the recent fills' mean size, one calibration point's before any)."""
        with self._lock:
            r = self._rates.get(tier)
            if r is None:
                return None
            if nbytes is None:
                sizes = [b for b, _ in r.fills] or [b for b, _ in r.anchors if b > 0] or [1.0]
                nbytes = sum(sizes) / len(sizes)
            return nbytes / max(r.seconds(nbytes), MIN_SECONDS)

    def seconds(self, tier: str, nblocks: int, block_bytes: int) -> float | None:
        """Predicted time to restore `nblocks` blocks of `block_bytes` from `tier` in one fill
        (0 for none), or None before the tier has a figure."""
        if nblocks <= 0:
            return 0.0
        with self._lock:
            r = self._rates.get(tier)
            return None if r is None else r.seconds(nblocks * block_bytes)

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {t: {"bytes_per_s": round(r.bytes_per_s), "latency_s": round(r.latency_s, 6),
                        "samples": r.samples, "source": r.source,
                        "recent": [{"predicted_s": round(p, 6), "observed_s": round(o, 6)} for p, o in r.errors],
                        "median_error": _median_error(r.errors)}
                    for t, r in self._rates.items()}

    def calibrate(self, layout: BlockLayout, read: Mapping[str, Codec], device: torch.device, blocks: int = 4) -> None:
        """Seed host (copies of one block and of `blocks` blocks into a device tensor: both terms)
        and each tier in `read` (a local tier below: its name -> its codec) with one block's
        decode, a lower bound of a cold read's time. A few milliseconds at start."""
        src = torch.randn((blocks, *layout.shape)).to(layout.dtype)
        dst = torch.empty((blocks, *layout.shape), dtype=layout.dtype, device=device)
        dst.copy_(src)                                      # warm up (first touch, allocation)

        def copy(n: int) -> float:
            best = float("inf")
            for _ in range(CALIBRATION_REPEATS):      # the best of a few: one copy is noise-sized
                t0 = time.perf_counter()
                dst[:n].copy_(src[:n])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t0)
            return max(best, MIN_SECONDS)
        points = [(float(n * layout.nbytes), copy(n)) for n in (1, blocks)]
        if points[1][1] <= points[0][1]:
            # NOTE: more bytes did not take longer (noise beat the copy): a two-point fit would say
            # the bytes are free (a latency and the floor: "TiB/s" in status, issue 40). The larger
            # copy's own rate, no latency, is what was measured.
            points = [(0.0, 0.0), points[1]]
        lat, spb = _fit([], points)
        self.seed("host", 1.0 / max(spb, 1e-15), lat, points=points)
        for name, codec in read.items():
            binding = payload_binding(b"\0" * 32, b"\0" * 32)
            payload = codec.encode(src[0], binding)
            out = torch.empty(layout.shape, dtype=layout.dtype)
            codec.decode(payload, binding, out)                 # warm up
            t0 = time.perf_counter()
            codec.decode(payload, binding, out)
            one = max(time.perf_counter() - t0, MIN_SECONDS)
            self.seed(name, layout.nbytes / one, 0.0, points=[(0.0, 0.0), (float(layout.nbytes), one)])


def _fit(fills, anchors) -> tuple[float, float]:
    """(latency_s, s_per_byte) >= 0 minimizing the weighted squared error over the fills (the
    newest weighs 1, each older one (1 - ALPHA) times the next) and the anchors (ANCHOR_WEIGHT
    each once there are fills, else 1)."""
    fills = list(fills)
    pts = [(x, y, (1 - ALPHA) ** (len(fills) - 1 - i)) for i, (x, y) in enumerate(fills)]
    pts += [(x, y, ANCHOR_WEIGHT if fills else 1.0) for x, y in anchors]
    sw = sum(w for *_, w in pts)
    sx = sum(w * x for x, _, w in pts)
    sy = sum(w * y for _, y, w in pts)
    sxx = sum(w * x * x for x, _, w in pts)
    sxy = sum(w * x * y for x, y, w in pts)
    det = sw * sxx - sx * sx
    if det > 1e-12 * max(sw * sxx, 1e-300):
        slope = (sw * sxy - sx * sy) / det
        lat = (sy - slope * sx) / sw
        if lat >= 0 and slope >= 0:
            return lat, max(slope, MIN_SECONDS / max(sx / sw, 1.0))
    # One of the terms is 0 (or the sizes do not vary): the better of the two one-term fits.
    through_origin = sxy / sxx if sxx > 0 else 0.0
    err_bw = sum(w * (y - through_origin * x) ** 2 for x, y, w in pts)
    mean = sy / sw
    err_lat = sum(w * (y - mean) ** 2 for _, y, w in pts)
    if through_origin > 0 and err_bw <= err_lat:
        return 0.0, through_origin
    return mean, MIN_SECONDS / max(sx / sw, 1.0)


def _median_error(pairs) -> float | None:
    """The median of |predicted - observed| / observed over the pairs (None without any)."""
    errs = sorted(abs(p - o) / o for p, o in pairs if o > 0)
    return None if not errs else round(errs[len(errs) // 2], 4)
