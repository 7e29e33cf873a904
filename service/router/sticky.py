"""OpenAI's `prompt_cache_key` behind the router: a key's requests stay on one backend.

Knows: the sticky map (tenant, prompt_cache_key) -> backend name, set when a request with a key is
routed (to the backend that took it, a retry's included), so the key's next requests follow it
even before the prefix index has anything to go on (different prompts, events not arrived yet).
Bounded: at most `max_entries` (least recently used dropped first), each entry good for `ttl_s`
since it was last used (the router's prediction_ttl_s). An entry whose backend has left rotation
(ejected, marked down) is dropped when it is next looked up, and when its backend leaves
(`drop_backend`). The tenant is the one the backend named for the prompt's block hashes; where
that is unknown, the caller's Authorization header, hashed (the router never keeps a key).
Doesn't know: the cost rule (policy.py: a sticky backend is credited the whole prompt there, so
load alone can still send a key elsewhere) or HTTP.
NOTE: used on the event loop only; no lock.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Callable, Mapping

MAX_ENTRIES = 65_536


def tenant_of(tenant: str | None, headers: Mapping[str, str]) -> str:
    """The tenant part of a sticky key: the backend's tenant, else a digest of the API key, else "-"."""
    if tenant is not None:
        return "t:" + tenant
    auth = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
    return "-" if auth is None else "k:" + hashlib.sha256(auth.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class StickyMap:
    def __init__(self, ttl_s: float, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str], up: set[str]) -> str | None:
        """The backend `key` sticks to, if its entry is fresh and that backend is in `up`."""
        got = self._entries.get(key)
        if got is None:
            return None
        backend, at = got
        if backend not in up or self.clock() - at > self.ttl_s:
            del self._entries[key]
            return None
        return backend

    def set(self, key: tuple[str, str], backend: str) -> None:
        self._entries[key] = (backend, self.clock())
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def drop_backend(self, backend: str) -> int:
        """Every entry on `backend` dropped (it left rotation); how many there were."""
        gone = [k for k, (b, _) in self._entries.items() if b == backend]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def held_by(self, backend: str) -> int:
        """How many keys stick to `backend` now (entries not yet dropped)."""
        return sum(1 for b, _ in self._entries.values() if b == backend)
