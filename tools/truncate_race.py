"""Truncates data.mdb under a DiskTier whose threads read it without pause: a race, not an injected
point, so some truncates land inside a transaction (after the files' check) -- the window that was
a SIGBUS. Counts, per truncate: crashes (the child process died of a signal), faults absorbed as
zeros (storage/disk/map_faults.py), stores moved aside, and blocks served that are not the stored
ones (must be 0). tools/live_drill.py does the same against a server, 25 s a trial; this does
hundreds of truncates in minutes.

    python tools/truncate_race.py [--processes 6] [--cuts 8] [--blocks 48] [--readers 2] [--json]

Each child: a tier of --blocks blocks, --readers threads calling get_many over all of them in a loop
(every hit compared with the block stored), and --cuts rounds of: refill, wait a random 0-30 ms,
truncate data.mdb to a random length, wait until the store was replaced. --cuts is at most 8: a
process that replaced 8 stores turns its disk tier off (storage/disk/replacement.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, os, random, sys, threading, time
import torch
from storage.disk.map_faults import absorbed
from storage.disk.tier import DiskTier
from tests.storage.disk_tier_child import make_block, make_key, same_bits
path, cuts, n, readers, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
SHAPE = (8, 2, 16, 4, 64)
rng = random.Random(seed)
t = DiskTier(path, 256 << 20, batch_blocks=8)
keys = [make_key(i) for i in range(n)]
blocks = [make_block(i, shape=SHAPE) for i in range(n)]
stop, wrong, served, reads = threading.Event(), [0], [0], [0]
def read():
    while not stop.is_set():
        got = t.get_many(keys)
        reads[0] += 1
        for g, b in zip(got, blocks):
            if g is not None:
                served[0] += 1
                wrong[0] += not same_bits(g, b)
for k, b in zip(keys, blocks):
    t.put(k, b)
assert t.drain(timeout=300)
threads = [threading.Thread(target=read, daemon=True) for _ in range(readers)]
for th in threads:
    th.start()
for c in range(cuts):
    for k, b in zip(keys, blocks):
        t.put(k, b)
    t.drain(timeout=300)
    before = t.stats().moved_aside
    time.sleep(rng.uniform(0, 0.03))
    data = os.path.join(path, "data.mdb")
    os.truncate(data, rng.randrange(0, os.path.getsize(data)))
    deadline = time.monotonic() + 120
    while t.stats().moved_aside == before and time.monotonic() < deadline:
        time.sleep(0.01)
stop.set()
for th in threads:
    th.join()
s = t.stats()
print(json.dumps({"cuts": cuts, "moved_aside": s.moved_aside, "absorbed": absorbed(), "wrong": wrong[0],
                  "served": served[0], "reads": reads[0], "unavailable": s.unavailable}))
t.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--cuts", type=int, default=8, choices=range(1, 9))
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows, started = [], time.monotonic()
    for p in range(args.processes):
        with tempfile.TemporaryDirectory(prefix="truncate-race-") as tmp:
            r = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "kv"), str(args.cuts),
                                str(args.blocks), str(args.readers), str(args.seed + p)], cwd=REPO,
                               capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": REPO})
        row = {"process": p, "rc": r.returncode}
        if r.returncode == 0:
            row.update(json.loads(r.stdout.strip().splitlines()[-1]))
        else:
            row["stderr"] = r.stderr[-1500:]
        rows.append(row)
        if not args.json:
            print(row, flush=True)
    total = {k: sum(r.get(k, 0) for r in rows) for k in ("cuts", "moved_aside", "absorbed", "wrong", "served")}
    total["crashes"] = sum(r["rc"] != 0 for r in rows)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_report import machine_note
    result = {"rows": rows, "total": total, "seconds": round(time.monotonic() - started), "config": vars(args),
              "machine": machine_note(f"load average {os.getloadavg()[0]:.1f}")}
    print(json.dumps(result) if args.json else f"total {total} in {result['seconds']} s; {result['machine']}")


if __name__ == "__main__":
    main()
