"""What opening the disk tier costs: the checks that keep a damaged store from crashing or hanging
a process (storage/disk/pagewalk.py's walk; the open's recount of counters and LRU index), beside
the limit measured in the same run -- a raw LMDB open plus one key scan of `meta`, which any
open that builds the in-memory index must do.

    python tools/bench_open.py                 # 20,000 blocks
    python tools/bench_open.py --blocks 5000 --repeat 5 --json

Prints a table, or with --json one JSON object.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lmdb  # noqa: E402

from storage.disk.pagewalk import check_pages  # noqa: E402
from storage.disk.tier import DiskTier  # noqa: E402
from tests.storage.disk_tier_child import make_block, make_key  # noqa: E402
sys.path.insert(0, str(REPO / "tools"))
from bench_report import emit, machine_note  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench-open-")
    try:
        with DiskTier(d, 1 << 34, batch_blocks=64) as t:
            for i in range(args.blocks):
                t.put(make_key(i), make_block(i, shape=(2, 2, 16, 2, 16)))
            t.drain()
        raw, walk, tier, pages = [], [], [], 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            env = lmdb.open(d, max_dbs=4, map_size=1 << 36)
            with env.begin() as txn:
                n = sum(1 for _ in txn.cursor(db=env.open_db(b"meta", txn=txn, create=False)).iternext(values=False))
            env.close()
            raw.append(time.perf_counter() - t0)
            env = lmdb.open(d, max_dbs=4, map_size=1 << 36)
            t0 = time.perf_counter()
            pages = check_pages(env, d)
            walk.append(time.perf_counter() - t0)
            env.close()
            t0 = time.perf_counter()
            DiskTier(d, 1 << 34).close()
            tier.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 1)   # noqa: E731
    rows = [("raw LMDB open + key scan of meta (limit)", ms(raw), 1.0),
            ("page walk (pointers, levels, overflow headers, free lists)", ms(walk), ms(walk) / ms(raw)),
            ("DiskTier open (walk, recount, LRU check, index)", ms(tier), ms(tier) / ms(raw))]
    report = {"blocks": n, "pages_walked": pages, "repeat": args.repeat,
              "median_ms": {"raw_open_scan": ms(raw), "page_walk": ms(walk), "disk_tier_open": ms(tier)},
              "machine": machine_note()}

    def table(_: dict) -> None:
        print(f"{n:,} blocks, {pages:,} pages walked; medians of {args.repeat}; {report['machine']}")
        print(f"{'step':<62} {'ms':>8} {'x limit':>8}")
        for name, v, x in rows:
            print(f"{name:<62} {v:>8} {x:>8.1f}")
    emit(report, args.json, table)


if __name__ == "__main__":
    main()
