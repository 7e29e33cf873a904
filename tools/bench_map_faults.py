"""What watching the store's maps (storage/disk/map_faults.py) costs a disk hit: the same DiskTier
read with the watch on (this code) and with it swapped for one that checks nothing (the gate as it
was before: the same transactions, the same copies and decodes), in alternating rounds of one run.

    python tools/bench_map_faults.py [--blocks 128] [--rounds 9] [--json]

Rows (each the median of --rounds, best beside it; warm page cache, the tier's decode threads):
    get_many      one get_many of --blocks blocks: a restore's read (one transaction)
    get x N       --blocks single-block gets: one transaction each (the watch's cost per transaction
                  is paid per get: its worst case)
    begin         an empty read transaction through the gate (EnvGate.begin): the floor of a get
    lmdb copy     the peer: py-lmdb alone, one read transaction copying every payload out of the map
                  (no gate, no checks, no decode): what any read of these bytes costs at least
    check         one MapWatch.check() (two atomic counter reads in the C module)
Blocks are SmolLM2-135M's (the default model: 30 layers, 3 KV heads, head dim 64, bf16, 16 tokens:
360 KiB raw), KV-like values, the default codec (byte planes, zstd on the sign/exponent plane).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import lmdb
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note  # noqa: E402
from storage.disk import map_faults  # noqa: E402
from storage.disk.tier import DiskTier  # noqa: E402
from storage.hashing import BlockKey, hash_block, root_hash  # noqa: E402

SHAPE = (30, 2, 16, 3, 64)


class NoWatch:
    """The gate before map_faults: checks nothing."""
    def check(self) -> None:
        pass

    def damage(self):
        return None

    def close(self) -> None:
        pass


def keys(n: int) -> list[BlockKey]:
    ns = bytes(32)
    parent, out = root_hash(ns), []
    for i in range(n):
        tokens = tuple(range(16 * i, 16 * i + 16))
        h = hash_block(parent, tokens)
        out.append(BlockKey(h, parent, tokens, ns))
        parent = h
    return out


def timed(fn, reps: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-map-faults-") as tmp:
        tier = DiskTier(os.path.join(tmp, "kv"), 1 << 30)
        ks = keys(args.blocks)
        g = torch.Generator().manual_seed(0)
        for k in ks:
            tier.put(k, (torch.randn(SHAPE, generator=g) * 0.5).to(torch.bfloat16))
        assert tier.drain(timeout=600)
        outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in ks]
        gate, watch = tier._gate, tier._gate.maps
        assert watch.watching, "the store's maps are not watched (storage/disk/_map_faults.c not built?)"

        def get_many() -> None:
            assert all(r is not None for r in tier.get_many(ks, outs))

        def get_each() -> None:
            for k, o in zip(ks, outs):
                assert tier.get(k, o) is not None

        def begin() -> None:
            with gate.begin():
                pass

        def lmdb_copy() -> None:
            with gate.env.begin(buffers=True) as txn:
                for k in ks:
                    bytes(txn.get(k.hash, db=gate.dbs.payload))

        rows: dict[str, dict[str, list[float]]] = {}
        get_many(), get_each()                                   # warm: page cache, buffers, pools
        for _ in range(args.rounds):
            for mode in ("watched", "unwatched"):                # alternating: the machine's noise shared
                gate.maps = watch if mode == "watched" else NoWatch()
                for name, fn, reps in (("get_many", get_many, 1), ("get x N", get_each, 1),
                                       ("begin", begin, 2000)):
                    rows.setdefault(name, {}).setdefault(mode, []).append(timed(fn, reps))
                tier.drain()                                     # the writer records the accesses: not timed
            rows.setdefault("lmdb copy", {}).setdefault("peer", []).append(timed(lmdb_copy))
            rows.setdefault("check", {}).setdefault("watched", []).append(timed(watch.check, 20000))
        gate.maps = watch
        raw = tier.stats().raw_bytes / max(1, tier.stats().blocks)
        tier.close()
    out = {}
    for name, modes in rows.items():
        out[name] = {m: {"median_s": statistics.median(v), "best_s": min(v)} for m, v in modes.items()}
        if "watched" in modes and "unwatched" in modes:
            out[name]["ratio_median"] = round(out[name]["watched"]["median_s"] / out[name]["unwatched"]["median_s"], 3)
    return {"rows": out, "blocks": args.blocks, "rounds": args.rounds, "raw_block_bytes": raw,
            "absorbed": map_faults.absorbed(), "machine": machine_note(f"load average {os.getloadavg()[0]:.1f}"),
            "lmdb": lmdb.__version__}


def print_table(res: dict) -> None:
    n = res["blocks"]
    print(f"{n} blocks of {res['raw_block_bytes'] / 1024:.0f} KiB raw, {res['rounds']} rounds (median, best)\n")
    print("| row | watched (this code) | unwatched (before) | watched / unwatched | per block or call |")
    print("|---|---:|---:|---:|---|")
    for name, r in res["rows"].items():
        def cell(mode: str) -> str:
            if mode not in r:
                return "-"
            return f"{r[mode]['median_s'] * 1e3:.3f} ms ({r[mode]['best_s'] * 1e3:.3f})"
        per = r.get("watched", r.get("peer"))["median_s"]
        unit = (f"{per / n * 1e6:.1f} us/block" if name in ("get_many", "get x N", "lmdb copy")
                else f"{per * 1e9:.0f} ns/call")
        w = cell("watched") if "watched" in r else cell("peer") + " (peer)"
        print(f"| {name} | {w} | {cell('unwatched')} | {r.get('ratio_median', '-')} | {unit} |")
    print(f"\n{res['machine']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    emit(run(ap.parse_args()), ap.parse_args().json, print_table)


if __name__ == "__main__":
    main()
