"""The last few minutes of hit tokens by tier, kept by the server so the dashboard's chart is
filled on its first paint (a page that only sampled for itself started empty on every load).

Knows: one sample every `interval_s` (2 s, the dashboard's poll) of each tier's hit-token
counter, the last `keep` of them (150: five minutes), taken by one asyncio task of the app
(`run`; the engine's status is read on a worker thread). The samples are owned by that task: it
appends, readers take a copy (`snapshot`) on the same event loop, so no lock is needed.
Doesn't know: what the dashboard draws from them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable

from engine.outputs import TIERS

log = logging.getLogger("tieredkv.service")


class HitHistory:
    def __init__(self, interval_s: float = 2.0, keep: int = 150) -> None:
        self.interval_s = interval_s
        self._samples: deque[tuple[float, dict[str, int]]] = deque(maxlen=keep)

    def add(self, status: dict[str, Any], now: float | None = None) -> None:
        tiers = status.get("tiers", {})
        self._samples.append((time.monotonic() if now is None else now,
                              {t: int(tiers.get(t, {}).get("hit_tokens") or 0) for t in TIERS}))

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """{"interval_s", "samples": [[seconds ago, {tier: hit tokens so far}], ...]}, oldest first."""
        now = time.monotonic() if now is None else now
        return {"interval_s": self.interval_s,
                "samples": [[round(now - t, 3), dict(h)] for t, h in self._samples]}

    async def run(self, cache_status: Callable[[], dict[str, Any]]) -> None:
        """Sample until cancelled; a failed status read skips one sample (a closed engine at shutdown)."""
        while True:
            try:
                self.add(await asyncio.to_thread(cache_status))
            except Exception:
                log.debug("hit history: the cache status failed; sample skipped", exc_info=True)
            await asyncio.sleep(self.interval_s)
