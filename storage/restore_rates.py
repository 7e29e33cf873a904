"""How fast each tier below the device restores blocks into the paged pool, as measured here.

Knows: one moving average of restore bytes per second per tier ("host", "disk", "remote"), fed
by the loader's own fills (bytes made usable in pages over the fill's wall time: read, verify,
decode and copy) and seeded at start by a short calibration (host: a block copy; disk: the
codec's decode of one block, the bound of a page-cache hit), so a planner has a figure before
the first fill. A seed is replaced by the first measurement.
Doesn't know: what to do with the figures (the compute-or-load planner of issue 18 will read them;
today cache_status, /metrics and `tieredkv status` show them).

Thread-safe: fills finish on loader workers while status is read from anywhere.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding
from storage.layout import BlockLayout

ALPHA = 0.2             # weight of a new measurement in the moving average


@dataclass(slots=True)
class Rate:
    bytes_per_s: float
    samples: int        # fills measured (0: the calibration's seed)
    source: str         # "calibration" or "measured"


class RestoreRates:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, Rate] = {}

    def seed(self, tier: str, bytes_per_s: float) -> None:
        with self._lock:
            if tier not in self._rates and bytes_per_s > 0:
                self._rates[tier] = Rate(bytes_per_s, 0, "calibration")

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """One fill of `tier`: `nbytes` restored into pages in `seconds` of wall time."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            r = self._rates.get(tier)
            if r is None or r.samples == 0:
                self._rates[tier] = Rate(rate, 1, "measured")
            else:
                r.bytes_per_s += ALPHA * (rate - r.bytes_per_s)
                r.samples += 1

    def get(self, tier: str) -> float | None:
        with self._lock:
            r = self._rates.get(tier)
            return None if r is None else r.bytes_per_s

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {t: {"bytes_per_s": round(r.bytes_per_s), "samples": r.samples, "source": r.source}
                    for t, r in self._rates.items()}

    def calibrate(self, layout: BlockLayout, codec: Codec | None, device: torch.device, blocks: int = 4) -> None:
        """Seed host (a copy of `blocks` blocks into a device tensor) and, with a codec, disk (one
        block's decode, a lower bound of a cold read's time). A few milliseconds at start."""
        src = torch.randn((blocks, *layout.shape)).to(layout.dtype)
        dst = torch.empty((blocks, *layout.shape), dtype=layout.dtype, device=device)
        dst.copy_(src)                                      # warm up (first touch, allocation)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seed("host", blocks * layout.nbytes / max(time.perf_counter() - t0, 1e-9))
        if codec is not None:
            binding = payload_binding(b"\0" * 32, b"\0" * 32)
            payload = codec.encode(src[0], binding)
            out = torch.empty(layout.shape, dtype=layout.dtype)
            codec.decode(payload, binding, out)                 # warm up
            t0 = time.perf_counter()
            codec.decode(payload, binding, out)
            self.seed("disk", layout.nbytes / max(time.perf_counter() - t0, 1e-9))
