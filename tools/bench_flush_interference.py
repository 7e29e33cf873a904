"""Flush and disk-restore interference, paired in one process: enough gaps per side that p99 means something.

Knows: how to run 2 streaming decoders for the whole run (each restarts its stream when it ends;
only gaps inside one stream count) and alternate, --rounds times at least and until each side
holds --min-gaps inter-token gaps, two windows of one case:

    case     side "base"                                   side "work"
    flush    the decoders alone, as long as the last        Engine.flush() of --prompts cached
             flush took (2 s the first round)               2048-token prompts (the disk tier
                                                            dropped first: every block is written)
    restore  a burst of --burst requests whose 2048-token   the same burst with the prefixes on
             prefixes are on device (16-token suffixes)     disk only (device and host dropped, the
                                                            OS page cache too where root can)
    busy     the decoders alone for --window s             one thread at nice +10 hashing --busy-kb
                                                            chunks (each sha256 call GIL-free) as long:
                                                            the GIL's cost alone, by how long it is held

A restore window is --window seconds or the burst, whichever is longer, on both sides. Other
processes' load changes minute to minute; alternating puts it on both sides alike, and pooling the
rounds gives p99 hundreds of gaps (one window of tools/bench_interference.py holds 10-30: its p99
is its worst gap). Reported per case: pooled p50/p99 per side, the pooled p99 ratio, the rounds'
p90 ratios (min / median / max: a window's p99 is its worst gap, its p90 is not), the sample counts,
and for flush the write rate while decoding and, after the rounds, with nothing decoding
(blocks/s: a write-behind slower than the cascade drops blocks).

Where the time went (Linux schedstat, per side, in cores: seconds per second of window): the
engine thread's CPU and runqueue wait, its sleeps per second (voluntary context switches: the
GIL, a lock, its OpenMP team's barrier), torch's native threads, the flush caller (main) and the
storage threads, and the disk writer's encode process (its threads: storage/codec/encode_process.py).
Knobs for experiments (each is the process's, set before the engine starts):
--switch-interval (sys.setswitchinterval), --torch-threads (torch.set_num_threads),
--encode-width (the disk encode pool's width while sequences decode; default: the product's),
--codec, --decode-step, --disk-dir, --flush-nice (the flush called from a thread at nice +10); and the
environment's TIEREDKV_ENCODE_PROCESS (0: encode in this process; nice: the encode process at nice +10, not SCHED_IDLE).
Other sessions' load on a shared machine reaches the baseline too; to keep it off, run in an
autogroup of its own at nice -10 (nice inside the process unchanged): `setsid sh -c 'echo -10 >
/proc/self/autogroup && exec python tools/bench_flush_interference.py ...'`.

Prints a table, or one JSON object with --json:
    {"cases": [{"name", "base_p50_ms", "base_p99_ms", "work_p50_ms", "work_p99_ms", "ratio_p99",
                "ratio_p50", "round_ratio_p90": [min, median, max], "rounds", "n_base", "n_work", ...}],
     "idle_flush": {"blocks", "s", "blocks_per_s"}, "config": {...}, "load": [before, after], "machine"}
    (a flush row also has "decoding_blocks_per_s_median" and "threads_cores": {side: {group: cores}})

    python tools/bench_flush_interference.py [--cases flush,restore,busy] [--rounds 6] [--min-gaps 300] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_interference import drop_page_cache, pct  # noqa: E402  (sibling scripts)
from bench_prompts import prose_ids  # noqa: E402
from bench_report import machine_note  # noqa: E402

SUFFIX = 16
SCHED: "Schedstat"      # set in main() once the engine runs


class Decoders:
    """Streaming decoders on threads for the whole run; every gap between two chunks of one stream,
    with the time of the later chunk."""

    def __init__(self, engine, n: int, tokens: int) -> None:
        from engine.sampling_params import SamplingParams
        self.gaps: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        tok = engine.tokenizer
        self._params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        self._threads = [threading.Thread(target=self._run, daemon=True,
                                          args=(engine, tok(f"decoder {i}: ")["input_ids"] + prose_ids(tok, 48, 977 * i),
                                                f"dec{i}")) for i in range(n)]

    def _run(self, engine, ids: list[int], tenant: str) -> None:
        while not self._stop.is_set():
            last = None
            for _ in engine.stream(ids, self._params, tenant=tenant):
                now = time.perf_counter()
                if last is not None:
                    with self._lock:
                        self.gaps.append((now, now - last))
                last = now
                if self._stop.is_set():
                    break

    def start(self) -> "Decoders":
        for t in self._threads:
            t.start()
        while len(self.gaps) < 8 * len(self._threads):     # every decoder past its prefill
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def window(self, t0: float, t1: float) -> list[float]:
        with self._lock:
            return [g for at, g in self.gaps if t0 <= at <= t1]


class Schedstat:
    """Where the process's threads spent a window (Linux /proc/<pid>/task/<tid>/schedstat: on a CPU,
    runnable but waiting for one), grouped: the engine thread, native threads Python does not know
    (torch's intra-op team), the flush caller (main), the storage threads, the rest."""

    def __init__(self, engine) -> None:
        self.engine_tid = engine._thread.native_id
        self._encoding = getattr(getattr(engine.cache, "disk", None), "_writer", None)
        self.sums: dict[str, dict[str, float]] = {}
        self._names: dict[int, str] = {}       # native id -> Python thread name, as seen at each snap

    def _group(self, tid: int, names: dict[int, str]) -> str:
        if tid == self.engine_tid:
            return "engine"
        name = names.get(tid)
        if isinstance(tid, tuple):
            return "encode_process"
        if name is None:
            return "native"
        if name == "MainThread":
            return "main"
        return "storage" if name.startswith("tieredkv-") else "other"

    def snap(self) -> dict[int, tuple[int, int]]:
        self._names.update((t.native_id, t.name) for t in threading.enumerate())
        out = {-1: (self._sleeps(), 0)}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    cpu, wait, _ = map(int, f.read().split())
                out[int(tid)] = (cpu, wait)
            except (OSError, ValueError):
                pass
        pid = self._child_pid()
        for tid in os.listdir(f"/proc/{pid}/task") if pid is not None and os.path.isdir(f"/proc/{pid}/task") else ():
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    cpu, wait, _ = map(int, f.read().split())
                out[(pid, int(tid))] = (cpu, wait)
            except (OSError, ValueError):
                pass
        return out

    def _child_pid(self) -> int | None:
        """The disk writer's encode process (storage/codec/encode_process.py), while one runs."""
        process = getattr(getattr(self._encoding, "_encoding", None), "_process", None)
        return getattr(process, "pid", None)

    def _sleeps(self) -> int:
        """The engine thread's voluntary context switches so far: each one a sleep (a futex: the GIL,
        a lock, its OpenMP team's barrier)."""
        with open(f"/proc/self/task/{self.engine_tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    def add(self, side: str, a: dict, b: dict, wall: float) -> None:
        names = self._names
        acc = self.sums.setdefault(side, {"wall": 0.0})
        acc["wall"] += wall
        acc["engine_sleeps_per_s"] = acc.get("engine_sleeps_per_s", 0.0) + b.pop(-1)[0] - a[-1][0]
        for tid, (cpu, wait) in b.items():
            c0, w0 = a.get(tid, (0, 0))
            g = self._group(tid, names)
            acc[g + "_cpu"] = acc.get(g + "_cpu", 0.0) + (cpu - c0) / 1e9
            acc[g + "_wait"] = acc.get(g + "_wait", 0.0) + (wait - w0) / 1e9

    def shares(self) -> dict[str, dict[str, float]]:
        """Per side: each group's CPU and runqueue wait in cores (seconds per second of window)."""
        return {side: {k: v / acc["wall"] for k, v in acc.items() if k != "wall"} for side, acc in self.sums.items()}


def timed(fn) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    return t0, time.perf_counter()


def summarize(name: str, pairs: list[tuple[list[float], list[float]]], extra: dict) -> dict:
    base = [g for b, _ in pairs for g in b]
    work = [g for _, w in pairs for g in w]
    per = [pct(w, .9) / pct(b, .9) for b, w in pairs if b and w]
    row = {"name": name, "base_p50_ms": pct(base, .5) * 1e3, "base_p99_ms": pct(base, .99) * 1e3,
           "work_p50_ms": pct(work, .5) * 1e3, "work_p99_ms": pct(work, .99) * 1e3,
           "ratio_p99": pct(work, .99) / pct(base, .99), "ratio_p50": pct(work, .5) / pct(base, .5),
           "round_ratio_p90": [min(per), statistics.median(per), max(per)] if per else None,
           "rounds": len(pairs), "n_base": len(base), "n_work": len(work)}
    row.update(extra)
    return row


def flush_call(engine, args):
    """engine.flush, or (--flush-nice, an experiment) the same call on a thread at background priority."""
    if not args.flush_nice:
        return engine.flush

    def call() -> None:
        from storage.priority import background_priority

        def run() -> None:
            background_priority()
            engine.flush()
        t = threading.Thread(target=run)
        t.start()
        t.join()
    return call


def run_flush(engine, dec: Decoders, args, fill) -> dict:
    fill("flush", args.prompts)
    pairs, rates, last = [], [], 2.0
    while len(pairs) < args.rounds or min(sum(len(b) for b, _ in pairs), sum(len(w) for _, w in pairs)) < args.min_gaps:
        if len(pairs) >= args.max_rounds:
            break
        sa = SCHED.snap()
        b0, b1 = timed(lambda: time.sleep(last))
        SCHED.add("base", sa, SCHED.snap(), b1 - b0)
        engine.drop_tier("disk")                            # every block the flush sees is written again
        before = engine.cache.disk.stats().blocks
        sa = SCHED.snap()
        w0, w1 = timed(flush_call(engine, args))
        SCHED.add("work", sa, SCHED.snap(), w1 - w0)
        rates.append((engine.cache.disk.stats().blocks - before) / (w1 - w0))
        last = w1 - w0
        pairs.append((dec.window(b0, b1), dec.window(w0, w1)))
    return summarize("flush", pairs, {"decoding_blocks_per_s_median": statistics.median(rates),
                                      "threads_cores": SCHED.shares()})


def run_restore(engine, dec: Decoders, args, tok) -> dict:
    from engine.sampling_params import SamplingParams
    one = SamplingParams(max_tokens=1)
    prefixes = [(tok(f"Document {i}.\n")["input_ids"] + prose_ids(tok, 2048, 5003 * (i + 1)))[:2048]
                for i in range(args.burst)]
    for i, p in enumerate(prefixes):
        engine.generate(p + [tok.eos_token_id or 0], one, tenant="burst")
    engine.flush()                                          # the prefixes on disk too
    k = [0]

    def burst() -> None:
        k[0] += 1
        ts = [threading.Thread(target=engine.generate, args=(p + prose_ids(tok, SUFFIX, 70001 + 31 * k[0] + i), one),
                               kwargs={"tenant": "burst"}) for i, p in enumerate(prefixes)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def window(cold: bool) -> list[float]:
        if cold:
            engine.drop_tier("device")
            engine.drop_tier("host")
            drop_page_cache()
        t0, t1 = timed(burst)
        t1 = max(t1, t0 + args.window)
        while time.perf_counter() < t1:
            time.sleep(0.01)
        return dec.window(t0, t1)
    pairs = []
    while len(pairs) < args.rounds or min(sum(len(b) for b, _ in pairs), sum(len(w) for _, w in pairs)) < args.min_gaps:
        if len(pairs) >= args.max_rounds:
            break
        base = window(cold=False)
        pairs.append((base, window(cold=True)))
    return summarize("restore", pairs, {"page_cache_dropped": drop_page_cache()})


def run_busy(engine, dec: Decoders, args) -> dict:
    """The mechanism alone: one thread at nice +10 hashing --busy-kb chunks (sha256 releases the GIL
    for each chunk) for --window s, beside the decoders alone as long. The same CPU work in small
    chunks takes the GIL back far more often than in large ones."""
    import hashlib
    from storage.priority import background_priority
    data = bytes(args.busy_kb << 10)

    def busy(stop: threading.Event) -> None:
        background_priority()
        while not stop.is_set():
            hashlib.sha256(data).digest()
    pairs = []
    while len(pairs) < args.rounds or min(sum(len(b) for b, _ in pairs), sum(len(w) for _, w in pairs)) < args.min_gaps:
        if len(pairs) >= args.max_rounds:
            break
        sa = SCHED.snap()
        b0, b1 = timed(lambda: time.sleep(args.window))
        SCHED.add("base", sa, SCHED.snap(), b1 - b0)
        stop = threading.Event()
        t = threading.Thread(target=busy, args=(stop,))
        sa = SCHED.snap()
        w0 = time.perf_counter()
        t.start()
        time.sleep(args.window)
        sb = SCHED.snap()                                    # while the busy thread is still there
        stop.set()
        t.join()
        w1 = time.perf_counter()
        SCHED.add("work", sa, sb, w1 - w0)
        pairs.append((dec.window(b0, b1), dec.window(w0, w1)))
    return summarize(f"busy{args.busy_kb}k", pairs, {"threads_cores": SCHED.shares()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="flush,restore")
    ap.add_argument("--rounds", type=int, default=6, help="pairs at least")
    ap.add_argument("--min-gaps", type=int, default=300, help="gaps each side holds at least (more rounds if not)")
    ap.add_argument("--max-rounds", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4, help="2048-token prompts whose blocks each flush writes")
    ap.add_argument("--burst", type=int, default=2, help="requests in the restore burst")
    ap.add_argument("--window", type=float, default=1.5, help="a restore window's shortest length, s")
    ap.add_argument("--busy-kb", type=int, default=64, help="the busy case's chunk (KiB) per GIL-free call")
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=300, help="tokens per stream before it restarts")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (default: as is)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads before the engine starts")
    ap.add_argument("--encode-width", type=int, default=None, help="the disk encode pool's width while decoding")
    ap.add_argument("--codec", default="zstd")
    ap.add_argument("--max-seqs", type=int, default=64, help="Engine(max_seqs=...): with 'compile', fewer buckets to build")
    ap.add_argument("--decode-step", default="auto", help="Engine(decode_step=...): 'compile' runs a decode step as one graph")
    ap.add_argument("--flush-nice", action="store_true", help="call Engine.flush from a thread at nice +10")
    ap.add_argument("--disk-dir", default=None, help="where the disk tier's store goes (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from storage.config import CacheConfig
    load0 = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="tieredkv-flush-interference-", dir=args.disk_dir)
    engine = Engine.from_pretrained(None, cache=CacheConfig(device_memory="1GiB", host_memory="64MiB", codec=args.codec,
                                                            disk_dir=os.path.join(tmp, "kv"), disk_capacity="8GiB"),
                                    decode_step=args.decode_step, max_seqs=args.max_seqs)
    writer = engine.cache.disk._writer
    if args.encode_width is not None:
        writer.encode_width.yielding = min(args.encode_width, writer.encode_width.full)
    tok, one = engine.tokenizer, SamplingParams(max_tokens=1)
    global SCHED
    SCHED = Schedstat(engine)

    def fill(tag: str, n: int) -> None:
        for i in range(n):
            engine.generate(tok(f"Flush {tag} {i}.\n")["input_ids"] + prose_ids(tok, 2048, 9001 * (i + 1)), one,
                            tenant="flush")
    rows, idle = [], {}
    try:
        dec = Decoders(engine, args.decoders, args.decode_tokens).start()
        try:
            for case in args.cases.split(","):
                if case == "flush":
                    rows.append(run_flush(engine, dec, args, fill))
                elif case == "busy":
                    SCHED.sums.clear()
                    rows.append(run_busy(engine, dec, args))
                elif case == "restore":
                    rows.append(run_restore(engine, dec, args, tok))
                else:
                    raise SystemExit(f"unknown case {case!r}")
        finally:
            dec.stop()
        if "flush" in args.cases:                       # the write rate with nothing decoding
            time.sleep(0.5)                             # the decoders' aborts taken
            engine.drop_tier("disk")
            before = engine.cache.disk.stats().blocks
            t0, t1 = timed(engine.flush)
            n = engine.cache.disk.stats().blocks - before
            idle = {"blocks": n, "s": t1 - t0, "blocks_per_s": n / (t1 - t0)}
    finally:
        engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config.update(switch_interval_s=sys.getswitchinterval(), torch_threads=torch.get_num_threads(),
                  encode_process=os.environ.get("TIEREDKV_ENCODE_PROCESS", "(default)"),
                  encode_width=[writer.encode_width.full, writer.encode_width.yielding])
    result = {"cases": rows, "idle_flush": idle, "config": config, "load": [load0, os.getloadavg()[0]],
              "machine": machine_note()}
    if args.json:
        print(json.dumps(result, default=lambda x: round(x, 4)))
        return 0
    print(f"Paired interference: {args.decoders} decoders; ITL ms pooled over the rounds "
          f"(switch interval {sys.getswitchinterval() * 1e3:g} ms, torch threads {torch.get_num_threads()}, "
          f"encode width {writer.encode_width.full}/{writer.encode_width.yielding}, codec {args.codec})")
    print(f"{'case':<8} {'base p50':>8} {'base p99':>8} {'work p50':>8} {'work p99':>8} {'ratio p99':>9} "
          f"{'ratio p50':>9} {'rounds p90 ratio min/med/max':>29} {'rounds':>6} {'n base':>6} {'n work':>6}")
    for r in rows:
        spread = "/".join(f"{x:.2f}" for x in r["round_ratio_p90"]) if r["round_ratio_p90"] else "-"
        print(f"{r['name']:<8} {r['base_p50_ms']:>8.1f} {r['base_p99_ms']:>8.1f} {r['work_p50_ms']:>8.1f} "
              f"{r['work_p99_ms']:>8.1f} {r['ratio_p99']:>9.2f} {r['ratio_p50']:>9.2f} {spread:>29} "
              f"{r['rounds']:>6} {r['n_base']:>6} {r['n_work']:>6}")
    for r in rows:
        for side, g in (r.get("threads_cores") or {}).items():
            print(f"  {r['name']} {side}: cores " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(g.items()) if v >= 0.005))
    if idle:
        print(f"flush with nothing decoding: {idle['blocks']} blocks in {idle['s']:.2f} s = {idle['blocks_per_s']:.0f} "
              f"blocks/s; while decoding (median round) {rows[0].get('decoding_blocks_per_s_median', 0):.0f} blocks/s")
    print(f"load average {result['load'][0]:.2f} -> {result['load'][1]:.2f}; machine: {result['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
