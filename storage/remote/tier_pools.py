"""The remote tier's thread pools, each built at its first use.

Knows: three pools of background-priority threads named `tieredkv-remote-<name>`: "fetch" (one MGET
in flight per thread, each on a connection of its own: `connections` threads), "send" (a write
batch's pipelines, used by the writer's thread only: `connections` threads) and "decode" (verify
and decode values; zstd and the copies release the GIL: `decode_threads`). A call that needs no
pool (one group, one part, one connection) gets None: its caller's thread does the work.
Doesn't know: what runs on them (storage/remote/tier.py).

Threads: any; `_lock` guards the dict of built pools (never held while a pool shuts down).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from storage.priority import background_priority


class RemotePools:
    def __init__(self, connections: int, decode_threads: int) -> None:
        self.connections, self.decode_threads = connections, decode_threads
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def fetcher(self, groups: int) -> ThreadPoolExecutor | None:
        """The pool whose threads each run one MGET at a time (on a connection of their own);
        None when there is one group or one connection: the caller's thread fetches."""
        return None if groups <= 1 or self.connections <= 1 else self._pool("fetch", self.connections)

    def sender(self, parts: int) -> ThreadPoolExecutor | None:
        """The writer thread's pool for a batch's pipelines (one per thread at a time); None for
        a batch of one part: the writer's thread sends it."""
        return None if parts <= 1 else self._pool("send", self.connections)

    def decoder(self) -> ThreadPoolExecutor:
        """The pool that verifies and decodes values."""
        return self._pool("decode", self.decode_threads)

    def close(self) -> None:
        """Shut every built pool down, waiting for its running tasks."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)

    def _pool(self, name: str, threads: int) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"tieredkv-remote-{name}",
                                                              initializer=background_priority)
            return pool
