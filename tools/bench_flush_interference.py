"""The flush case of tools/bench_interference.py, repeated and paired, for a machine under load.

Knows: how to take --rounds pairs of windows -- 2 decoders alone for 2 s, then the same decoders
while Engine.flush() writes the blocks of --prompts fresh 2048-token prompts -- and pool each
side's inter-token gaps across rounds, so that other processes' load, which changes from minute
to minute, falls on both sides alike (one window of bench_interference holds 10-30 gaps: its p99
is its worst gap, and on a shared 2-core VM its ratio went from 0.8 to 2.2 between runs of the
same code). Then a flush of 2 x --prompts prompts with nothing decoding: the writer's blocks/s.
Prints one JSON line:
    {"alone_p50", "alone_p99", "flush_p50", "flush_p99" (ms), "pooled_ratio_p99",
     "median_round_ratio", "rounds", "n_alone", "n_flush", "idle_flush_blocks", "idle_flush_s",
     "idle_blocks_per_s", "load"}

    python tools/bench_flush_interference.py [--rounds 8] [--prompts 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_interference as bi  # noqa: E402  (sibling scripts)
from bench_prompts import prose_ids  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2, help="2048-token prompts whose blocks each flush writes")
    ap.add_argument("--decode-tokens", type=int, default=120)
    args = ap.parse_args()
    args.decoders = 2
    tmp = tempfile.mkdtemp(prefix="tieredkv-flush-interference-")
    engine = Engine.from_pretrained(None, cache=CacheConfig(device_memory="1GiB", host_memory="64MiB",
                                                            disk_dir=os.path.join(tmp, "kv"), disk_capacity="8GiB"))
    tok, one = engine.tokenizer, SamplingParams(max_tokens=1)

    def fill(tag: str, n: int) -> None:
        for i in range(n):
            engine.generate(tok(f"Flush {tag} {i}.\n")["input_ids"] + prose_ids(tok, 2048, 9001 * (i + 1)), one,
                            tenant="flush")
    alone_all: list[float] = []
    flush_all: list[float] = []
    per: list[float] = []
    try:
        for r in range(args.rounds):
            alone = bi.measure(engine, args, f"a{r}", lambda: time.sleep(2.0))
            fill(f"r{r}", args.prompts)
            flushing = bi.measure(engine, args, f"f{r}", engine.flush)
            alone_all += alone
            flush_all += flushing
            if alone and flushing:
                per.append(bi.pct(flushing, .99) / bi.pct(alone, .99))
        fill("idle", 2 * args.prompts)
        before = engine.cache.disk.stats().blocks
        t0 = time.perf_counter()
        engine.flush()
        idle_s = time.perf_counter() - t0
        written = engine.cache.disk.stats().blocks - before
    finally:
        engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"alone_p50": bi.pct(alone_all, .5) * 1e3, "alone_p99": bi.pct(alone_all, .99) * 1e3,
           "flush_p50": bi.pct(flush_all, .5) * 1e3, "flush_p99": bi.pct(flush_all, .99) * 1e3,
           "pooled_ratio_p99": bi.pct(flush_all, .99) / bi.pct(alone_all, .99),
           "median_round_ratio": statistics.median(per), "rounds": [round(x, 2) for x in per],
           "n_alone": len(alone_all), "n_flush": len(flush_all), "idle_flush_blocks": written,
           "idle_flush_s": idle_s, "idle_blocks_per_s": written / idle_s, "load": os.getloadavg()[0]}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
