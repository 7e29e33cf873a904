"""How long a host -> device fill holds the tiers' lock, and how long the engine waits for it.

Knows: one TieredKVCache on this machine's device (the CPU when there is no GPU) whose tiers'
lock is wrapped to time every outermost hold; blocks of a model's KV shape (random bytes: the
copy does not care what they hold) placed in the host tier only; a fill of all of them through
the real loader (plan, then wait), while a probe thread plays the engine's bookkeeping (take the
lock, let it go, 0.2 ms apart) and records how long each take waited. Per round: the fill's wall
time, the longest single hold and the sum of holds by the loader's threads, the probe's longest
wait. The best (smallest) of --repeat rounds is kept for each figure.

Issue 18, item 3: before it, a host fill held the lock across its whole batch of copies (and,
on CUDA, their synchronize), so the longest hold was the whole fill; after, it holds the lock for
bookkeeping only (pin the slots, unpin them, finish the fills).

    python tools/bench_fill_lock.py [--layout smollm2|llama8b] [--blocks 128] [--repeat 5] [--json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)          # this checkout's storage/, not an installed copy
from bench_report import emit, machine_note  # noqa: E402  (a sibling script)
from storage.config import CacheConfig  # noqa: E402
from storage.hashing import block_keys  # noqa: E402
from storage.layout import BlockLayout  # noqa: E402
from storage.tiered_cache import TieredKVCache  # noqa: E402

LAYOUTS = {   # a block of 16 tokens of each model's KV, bf16
    "smollm2": BlockLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16),
    "llama8b": BlockLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
}


class TimedLock:
    """The tiers' RLock, with the length of every outermost hold recorded per thread name."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._local = threading.local()
        self.holds: list[tuple[str, float]] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self.inner.acquire(blocking, timeout)
        if ok:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._local.t0 = time.perf_counter()
            self._local.depth = depth + 1
        return ok

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self.holds.append((threading.current_thread().name, time.perf_counter() - self._local.t0))
        self.inner.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def one_round(cache: TieredKVCache, lock: TimedLock, keys, blocks: torch.Tensor) -> dict:
    cache.drop("device")
    cache.drop("host")
    for key, block in zip(keys, blocks):            # untimed: every block in the host tier only
        cache.host.slab[cache.host.reserve(key)].copy_(block)
    match = cache.match(keys)
    assert [t for _, t in match.blocks] == ["host"] * len(keys)
    waits: list[float] = []
    stop = threading.Event()

    def probe() -> None:                            # the engine's bookkeeping, between steps
        while not stop.is_set():
            t0 = time.perf_counter()
            with lock:
                waits.append(time.perf_counter() - t0)
            time.sleep(0.0002)
    prober = threading.Thread(target=probe, name="probe")
    prober.start()
    lock.holds.clear()
    t0 = time.perf_counter()
    load = cache.start_load(match)
    assert load.wait(60)
    fill_s = time.perf_counter() - t0
    stop.set()
    prober.join()
    got = cache.finish_load(load)
    assert got.tiers == ("host",) * len(keys)
    assert torch.equal(cache.pool.kv[got.pages[-1]].view(torch.uint8), blocks[-1].view(torch.uint8))
    cache.release(got.pages)
    loader = [s for name, s in lock.holds if name.startswith("tieredkv-load")]
    return {"fill_ms": fill_s * 1e3, "loader_max_hold_ms": max(loader) * 1e3,
            "loader_total_hold_ms": sum(loader) * 1e3, "probe_max_wait_ms": max(waits) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layout = LAYOUTS[args.layout]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = block_keys(b"\x02" * 32, list(range(args.blocks * layout.block_size)), layout.block_size)
    blocks = torch.randn((args.blocks, *layout.shape)).to(layout.dtype)
    with tempfile.TemporaryDirectory(prefix="tieredkv-fill-lock-") as tmp:
        nbytes = args.blocks * layout.nbytes
        config = CacheConfig(block_size=layout.block_size, device_memory=nbytes, host_memory=nbytes,
                             disk_dir=os.path.join(tmp, "disk"), disk_capacity=4 * nbytes)
        cache = TieredKVCache(layout, config, num_pages=args.blocks, device=device)
        lock = TimedLock(cache.tiers.lock)
        cache.tiers.lock = cache._lock = lock       # one lock for the cache, the loader and the cascade
        try:
            one_round(cache, lock, keys, blocks)      # warm: pages and slots touched once
            rounds = [one_round(cache, lock, keys, blocks) for _ in range(args.repeat)]
        finally:
            cache.close()
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    result = {"bench": "fill_lock", "layout": args.layout, "blocks": args.blocks,
              "mib": round(args.blocks * layout.nbytes / 2**20, 1), "device": device,
              **{k: round(v, 3) for k, v in best.items()}, "machine": machine_note()}

    def table(r: dict) -> None:
        print(f"host -> device fill of {r['blocks']} {r['layout']} blocks ({r['mib']} MiB) on {r['device']}, "
              f"best of {args.repeat}")
        for k in ("fill_ms", "loader_max_hold_ms", "loader_total_hold_ms", "probe_max_wait_ms"):
            print(f"  {k:22s} {r[k]:9.3f}")
        print(r["machine"])
    emit(result, args.json, table)


if __name__ == "__main__":
    main()
