"""Durable writes of the same KV bytes in the on-disk layouts a disk tier could have: a decision aid.

Knows: how fast this machine's drive takes fsync'd writes of 16-token blocks (SmolLM2 bf16 by
default: 360 KiB each, incompressible bytes: no codec runs, only the layout is timed) in five
layouts, each round running every layout back to back so the load of other processes hits them
alike, the best of --rounds kept:

    layout          what is written, and synced how
    lmdb_fresh      one LMDB environment, new each round (the file grows), 32 blocks per durable
                    write transaction: our disk tier's layout on an empty store
    lmdb_reused     the same, in one environment whose previous round was deleted first (pages
                    reused): our layout on a full store that evicts as it writes
    segments_batch  per 32-block batch, --threads files written (pwritev) and fdatasync'd in
                    parallel, the directory fsync'd, then an LMDB index of 32 small records
                    committed durably -- batch by batch (the index of batch k commits while batch
                    k+1's files are written)
    segments_deep   the same, every batch's files submitted at once (no barrier between batches),
                    the index committed batch by batch as their files land
    chunk_files     LMCache's local disk with an fsync per file: one file per 256-token chunk
                    (16 blocks), 4 threads, each file fsync'd (the I/O pattern only; the peer itself
                    is timed by tools/bench_peers.py)

GB/s counts the blocks' bytes (the best round); "x chunk_files" is each layout's rate over
chunk_files' in the same round, the median of the rounds (each round's in the JSON). It answers whether moving payloads out of LMDB (segment files, LMDB as the index) would
meet issue 38's durable put target (>= 1.0x LMCache + fsync) on this drive; it is not a tier.

    python tools/bench_durable_layouts.py [--blocks 256] [--threads 4] [--rounds 4] [--json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note  # noqa: E402  (a sibling script)

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2      # SmolLM2-135M, one 16-token block in bf16
BATCH = 32                                  # the disk writer's blocks per transaction
CHUNK_BLOCKS = 16                           # LMCache's default 256-token chunk
LAYOUTS = ("lmdb_fresh", "lmdb_reused", "segments_batch", "segments_deep", "chunk_files")


class Layouts:
    def __init__(self, payloads: list[bytes], root: str, threads: int) -> None:
        self.payloads, self.root, self.threads = payloads, root, threads
        self.n = len(payloads)
        self.files = ThreadPoolExecutor(threads)
        self.chunks = ThreadPoolExecutor(4)
        self.index = ThreadPoolExecutor(1)
        self.reused = lmdb.open(os.path.join(root, "reused"), map_size=4 * self.n * BLOCK_BYTES)
        self.round = 0

    def close(self) -> None:
        for pool in (self.files, self.chunks, self.index):
            pool.shutdown()
        self.reused.close()

    def _lmdb(self, env: lmdb.Environment) -> float:
        t0 = time.perf_counter()
        for s in range(0, self.n, BATCH):
            with env.begin(write=True) as txn:
                for i in range(s, min(s + BATCH, self.n)):
                    txn.put(b"%d-%d" % (self.round, i), self.payloads[i])
        return time.perf_counter() - t0

    def lmdb_fresh(self) -> float:
        path = os.path.join(self.root, f"fresh-{self.round}")
        env = lmdb.open(path, map_size=2 * self.n * BLOCK_BYTES)
        try:
            return self._lmdb(env)
        finally:
            env.close()
            shutil.rmtree(path)

    def lmdb_reused(self) -> float:
        with self.reused.begin(write=True) as txn:            # untimed: the last round evicted
            txn.drop(self.reused.open_db(None, txn=txn), delete=False)
        return self._lmdb(self.reused)

    def _segments(self, deep: bool) -> float:
        d = os.path.join(self.root, f"seg-{self.round}-{int(deep)}")
        os.makedirs(d)
        env = lmdb.open(os.path.join(d, "index"), map_size=64 << 20)
        dfd = os.open(d, os.O_RDONLY)

        def write(part: list[int]) -> list[tuple[int, bytes]]:
            name = os.path.join(d, f"seg-{part[0]}")
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.pwritev(fd, [self.payloads[i] for i in part], 0)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            return [(i, name.encode()) for i in part]

        def commit(records: list[tuple[int, bytes]]) -> None:
            os.fsync(dfd)     # the new files' names durable before the index names them
            with env.begin(write=True) as txn:
                for i, name in records:
                    txn.put(b"%d" % i, name)

        def parts(s: int) -> list[list[int]]:
            ids = list(range(s, min(s + BATCH, self.n)))
            return [ids[j::self.threads] for j in range(self.threads) if ids[j::self.threads]]

        try:
            t0 = time.perf_counter()
            batches = range(0, self.n, BATCH)
            if deep:
                futures = [[self.files.submit(write, p) for p in parts(s)] for s in batches]
                landed = ([r for f in fs for r in f.result()] for fs in futures)
            else:
                landed = ([r for got in self.files.map(write, parts(s)) for r in got] for s in batches)
            pending = None
            for records in landed:
                if pending is not None:
                    pending.result()
                pending = self.index.submit(commit, records)
            pending.result()
            return time.perf_counter() - t0
        finally:
            env.close()
            os.close(dfd)
            shutil.rmtree(d)

    def segments_batch(self) -> float:
        return self._segments(deep=False)

    def segments_deep(self) -> float:
        return self._segments(deep=True)

    def chunk_files(self) -> float:
        d = os.path.join(self.root, f"chunks-{self.round}")
        os.makedirs(d)

        def chunk(c: int) -> None:
            with open(os.path.join(d, f"{c}.bin"), "wb") as f:
                for i in range(c * CHUNK_BLOCKS, min((c + 1) * CHUNK_BLOCKS, self.n)):
                    f.write(self.payloads[i])
                f.flush()
                os.fsync(f.fileno())
        try:
            t0 = time.perf_counter()
            list(self.chunks.map(chunk, range(-(-self.n // CHUNK_BLOCKS))))
            return time.perf_counter() - t0
        finally:
            shutil.rmtree(d)


def print_table(res: dict) -> None:
    cfg = res["config"]
    print(f"Durable writes of {cfg['blocks']} blocks of {cfg['block_bytes'] // 1024} KiB, best of "
          f"{cfg['rounds']} rounds; segment files on {cfg['threads']} threads")
    print(f"{'layout':<16} {'GB/s':>7}  {'x chunk_files (median of rounds)':>33}")
    for name in LAYOUTS:
        print(f"{name:<16} {res['gbps'][name]:7.3f}  {res['x_chunk_files'][name]:33.2f}")
    print(res["machine"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4, help="segment files written at once")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.blocks, args.threads, args.rounds) < 1:
        ap.error("--blocks, --threads and --rounds: expected >= 1")
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(args.blocks)]
    root = tempfile.mkdtemp(prefix="tieredkv-bench-layouts-")
    best = dict.fromkeys(LAYOUTS, float("inf"))
    ratios: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    try:
        lay = Layouts(payloads, root, args.threads)
        try:
            for r in range(args.rounds):
                lay.round = r
                times = {name: getattr(lay, name)() for name in LAYOUTS}
                for name, t in times.items():
                    best[name] = min(best[name], t)
                    ratios[name].append(times["chunk_files"] / t)
                if not args.json:
                    print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            lay.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = args.blocks * BLOCK_BYTES
    res = {"gbps": {name: round(nbytes / t / 1e9, 3) for name, t in best.items()},
           # the median of the rounds' paired ratios (both sides timed in the same round)
           "x_chunk_files": {name: round(statistics.median(x), 3) for name, x in ratios.items()},
           "x_chunk_files_rounds": {name: [round(v, 3) for v in x] for name, x in ratios.items()},
           "config": {"blocks": args.blocks, "block_bytes": BLOCK_BYTES, "threads": args.threads,
                      "rounds": args.rounds, "batch": BATCH, "chunk_blocks": CHUNK_BLOCKS},
           "machine": machine_note()}
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
