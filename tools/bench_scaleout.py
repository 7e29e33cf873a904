"""Scale-out: 1, 2 and 4 `tieredkv serve` processes behind round-robin, behind `tieredkv route`, and
behind the router with a shared remote tier; then, with 2+ servers, a backend SIGKILLed mid-run.

Knows: how to start real servers (`tieredkv serve --port 0 --kv-events ipc://DIR/kv-events/events.sock`,
each with its own empty cache dir DIR, its events on a socket only this user can reach;
with the remote tier also `--remote-url U --remote-write write_through`, so a block reaches the
store as soon as it is computed), a valkey-server (tools/valkey_servers.py) and a router
(`tieredkv route --port 0 --backend ...`) in front of each group; the workload; what to report.

The workload: --documents tenants, each with one document (the demo document cut to
--doc-tokens tokens: a tenant's system prompt), asked --requests / --documents questions each, in
one seeded shuffled order, --concurrency requests in flight, greedy, --max-tokens tokens, every
request streamed (its TTFT is the first text chunk's arrival). Round-robin sends request i to
server i % n. Every run uses tenants no other run used (cold namespaces everywhere), so runs
never hit each other's blocks; the modes take turns within a server count.

    req/s      requests / the wall time from the first request sent to the last answer
    hit rate   prompt tokens billed as a hit of any tier / prompt tokens (the servers' own usage)
    limit      the hit rate of one cache shared perfectly: each request hits the longest prefix it
               shares with an earlier request of its tenant (capped at len - 1, whole blocks)
    TTFT       p50 and p99 of the time to the first text chunk, client side
    failed     requests that got no answer (no 200, or the stream ended before its first byte)
    cut        streams that had started answering and ended with an error event: their server
               died mid-answer (bytes already sent cannot be taken back, so no proxy retries them)

The kill run (router mode, local tiers, 2+ servers): once a third of the requests are answered,
server 0 is SIGKILLed with requests in flight; every request must still succeed (the router
retries what had not started answering, and stops routing to the dead server).

    python tools/bench_scaleout.py [--servers 1,2,4] [--requests 24] [--documents 4] [--concurrency 4]
                                   [--max-tokens 4] [--doc-tokens 512] [--repeat 2] [--no-kv-events]
                                   [--model M] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
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
MODES = ("round-robin", "router", "router+remote")
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


class Process:
    """A `tieredkv` command in a subprocess; its stderr read on a thread, waited on for a line."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in self.proc.stderr], daemon=True).start()

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                if m := re.search(pattern, ln):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"no line matching {pattern!r}: {''.join(self.lines)[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()


class Server(Process):
    def __init__(self, cache_dir: Path, model: str | None, remote_url: str | None, kv_events: bool = True) -> None:
        args = ["serve", "--port", "0", "--cache-dir", str(cache_dir), "--device-memory", "256MiB",
                "--host-memory", "256MiB", "--log-level", "warning"]
        if kv_events:
            # A private ipc socket each (the router runs as the same user; tcp would take CURVE keys);
            # the router reads it from the server's status.
            args += ["--kv-events", f"ipc://{cache_dir}/kv-events/events.sock"]
        if model:
            args += ["--model", model]
        if remote_url:
            args += ["--remote-url", remote_url, "--remote-write", "write_through"]
        super().__init__(args)
        m = self.wait_line(r"serving (\S+) on (http://\S+) ", 300)
        self.model, self.url = m[1], m[2]
        if remote_url:
            self.wait_line(r"remote tier .*: reachable", 30)


class Router(Process):
    def __init__(self, backends: list[str]) -> None:
        args = ["route", "--port", "0", "--log-level", "warning"]
        for b in backends:
            args += ["--backend", b]
        super().__init__(args)
        self.url = self.wait_line(r"routing on (http://\S+) ", 60)[1]
        deadline = time.monotonic() + 30
        while httpx.get(f"{self.url}/health", timeout=10).json()["backends_up"] < len(backends):
            if time.monotonic() > deadline:
                raise RuntimeError("router: not every backend is up")
            time.sleep(0.2)


def document(tokenizer, doc_tokens: int) -> str:
    text = (REPO / "tieredkv" / "demo_document.txt").read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    return text if doc_tokens <= 0 or len(ids) <= doc_tokens else tokenizer.decode(ids[:doc_tokens])


def workload(n: int, documents: int, seed: int = 0) -> list[tuple[int, int]]:
    """(document, question) per request: n // documents questions each, in one seeded shuffled order."""
    items = [(d, q) for d in range(documents) for q in range(max(1, n // documents))]
    random.Random(seed).shuffle(items)
    return items


def prompt(doc: str, question: int) -> str:
    return (f"{doc}\n\nQuestion: {QUESTIONS[question % len(QUESTIONS)]}"
            + (f" (asked {question // len(QUESTIONS) + 1} times)" if question >= len(QUESTIONS) else "") + "\nAnswer:")


def ideal_hits(token_lists: list[list[int]], tenants: list[int], block: int) -> list[int]:
    """Per request, what one perfectly shared cache would bill as hits: the longest prefix shared
    with an earlier request of the same tenant, capped at len - 1, in whole blocks."""
    out = []
    for i, ids in enumerate(token_lists):
        best = 0
        for prev, t in zip(token_lists[:i], tenants[:i]):
            if t != tenants[i]:
                continue
            n = 0
            while n < min(len(ids), len(prev)) and ids[n] == prev[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(ids) - 1) // block * block)
    return out


class CutMidStream(RuntimeError):
    """A stream that had started answering and ended with an error event (its server died)."""


def stream_one(client: httpx.Client, url: str, model: str, text: str, user: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, usage, out, backend = None, None, [], None
    with client.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "user": user,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        backend = r.headers.get("x-tieredkv-backend")
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise CutMidStream(f"stream error after {len(out)} text chunks: {chunk['error']['message']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    out.append(c["text"])
    if not done or usage is None:
        raise RuntimeError("the stream ended without [DONE] and usage")
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "latency_s": time.perf_counter() - t0,
            "usage": usage, "text": "".join(out), "backend": backend}


def run_workload(urls: list[str], model: str, texts: list[str], tenants: list[str], concurrency: int,
                 max_tokens: int, on_progress=None) -> dict:
    """Every prompt, request i to urls[i % len(urls)] (one URL: the router), `concurrency` at a time."""
    client = httpx.Client(timeout=600)
    results: list[dict | None] = [None] * len(texts)
    errors: list[str] = []
    cut = [0]
    next_i = iter(range(len(texts)))
    lock = threading.Lock()
    finished = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            try:
                results[i] = stream_one(client, urls[i % len(urls)], model, texts[i], tenants[i], max_tokens)
            except Exception as e:              # a failed request is counted, not fatal
                with lock:
                    errors.append(f"request {i}: {type(e).__name__}: {e}"[:300])
                    cut[0] += isinstance(e, CutMidStream)
            with lock:
                finished[0] += 1
                n = finished[0]
            if on_progress is not None:
                on_progress(n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    client.close()
    return {"wall_s": wall, "results": results, "errors": errors, "cut_mid_stream": cut[0]}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


def summarize(mode: str, servers: int, run: dict, ideal: list[int]) -> dict:
    ok = [(r, i) for r, i in zip(run["results"], ideal) if r is not None]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r, _ in ok)
    hit = sum(r["usage"]["prompt_cache_hit_tokens"] for r, _ in ok)
    limit = sum(i for _, i in ok)
    by_tier: dict[str, int] = {}
    for r, _ in ok:
        for t, n in r["usage"]["prompt_cache_hit_tokens_by_tier"].items():
            by_tier[t] = by_tier.get(t, 0) + n
    ttfts = [r["ttft_s"] for r, _ in ok]
    per_backend: dict[str, int] = {}
    for r, _ in ok:
        per_backend[r["backend"] or "direct"] = per_backend.get(r["backend"] or "direct", 0) + 1
    return {"servers": servers, "mode": mode, "requests": len(run["results"]), "failed": len(run["errors"]),
            "cut_mid_stream": run["cut_mid_stream"], "failed_before_answer": len(run["errors"]) - run["cut_mid_stream"],
            "errors": run["errors"][:5], "wall_s": round(run["wall_s"], 3),
            "req_per_s": round(len(ok) / run["wall_s"], 3), "prompt_tokens": prompt_tokens, "hit_tokens": hit,
            "hit_rate": round(hit / prompt_tokens, 4) if prompt_tokens else 0.0,
            "hit_rate_limit": round(limit / prompt_tokens, 4) if prompt_tokens else 0.0,
            "hit_tokens_by_tier": by_tier, "ttft_p50_s": round(pct(ttfts, 0.5), 3),
            "ttft_p99_s": round(pct(ttfts, 0.99), 3), "requests_per_backend": per_backend,
            "texts": [None if r is None else r["text"] for r in run["results"]]}


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
    ap.add_argument("--servers", default="1,2,4", help="comma-separated server counts, one group each")
    ap.add_argument("--requests", type=int, default=24, help="requests per run")
    ap.add_argument("--documents", type=int, default=4, help="tenants, each with its own copy of the document")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (greedy)")
    ap.add_argument("--doc-tokens", type=int, default=512, help="the document cut to this many tokens (0: whole)")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--remote-url", default=None, help="the shared store (default: a valkey-server of the script's own)")
    ap.add_argument("--block-size", type=int, default=16, help="the servers' block size (for the limit)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per (servers, mode), the modes' order rotated "
                    "each round; the run with the median req/s is shown")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill runs")
    ap.add_argument("--no-kv-events", action="store_true", help="servers publish no KV events: the router routes "
                    "on its own predictions only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.servers.split(",") if x.strip()]
    if args.requests < 2 or args.documents < 1 or args.concurrency < 1 or not counts or min(counts) < 1:
        ap.error("--requests >= 2, --documents >= 1, --concurrency >= 1, --servers of ints >= 1")
    tok = tokenizer_for(args.model)
    doc = document(tok, args.doc_tokens)
    order = workload(args.requests, args.documents, args.seed)
    texts = [prompt(doc, q) for _, q in order]
    ideal = ideal_hits([list(tok(t)["input_ids"]) for t in texts], [d for d, _ in order], args.block_size)
    run_id = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="tieredkv-scaleout-"))
    store = None
    rows: list[dict] = []
    try:
        url = args.remote_url
        if url is None:
            store = own_store()
            url = store.url
        for n in counts:
            print(f"{n} server(s): starting {2 * n} servers (n local, n sharing the store) and two routers",
                  file=sys.stderr)
            events = not args.no_kv_events
            local = [Server(tmp / f"n{n}-local-{i}", args.model, None, events) for i in range(n)]
            remote = [Server(tmp / f"n{n}-remote-{i}", args.model, url, events) for i in range(n)]
            routers: list[Router] = []
            try:
                routers = [Router([s.url for s in local]), Router([s.url for s in remote])]
                model = local[0].model
                for s in local + remote:     # first-call costs at the workload's sizes, untimed, a tenant of their own
                    for text in (texts[0], texts[1]):
                        httpx.post(f"{s.url}/v1/completions", json={"model": model, "prompt": text, "max_tokens": 2,
                                                                    "user": f"warmup-{run_id}"}, timeout=600)
                targets = {"round-robin": [s.url for s in local], "router": [routers[0].url],
                           "router+remote": [routers[1].url]}
                samples: dict[str, list[dict]] = {}
                for rep in range(args.repeat):
                    # The modes take turns, their order rotated each round: load from outside this
                    # script, and a server's first runs, fall on every mode alike.
                    for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
                        tenants = [f"scaleout-{run_id}-n{n}-{mode}-r{rep}-doc{d}" for d, _ in order]
                        run = run_workload(targets[mode], model, texts, tenants, args.concurrency, args.max_tokens)
                        row = summarize(mode, n, run, ideal)
                        samples.setdefault(mode, []).append(row)
                        print(f"  round {rep + 1} {mode}: {row['req_per_s']:.2f} req/s, hit rate {row['hit_rate']:.1%} "
                              f"(limit {row['hit_rate_limit']:.1%}), TTFT p50 {row['ttft_p50_s']:.2f}s, "
                              f"failed {row['failed']}", file=sys.stderr)
                for mode in MODES:
                    runs = samples[mode]
                    median = statistics.median(r["req_per_s"] for r in runs)
                    row = dict(min(runs, key=lambda r: abs(r["req_per_s"] - median)))
                    row["req_per_s_runs"] = [r["req_per_s"] for r in runs]
                    row["hit_rate_runs"] = [r["hit_rate"] for r in runs]
                    row["failed"] = sum(r["failed"] for r in runs)
                    rows.append(row)
                if n >= 2 and not args.no_kill:
                    tenants = [f"scaleout-{run_id}-n{n}-kill-doc{d}" for d, _ in order]
                    fired = threading.Event()

                    def progress(done: int, victim: Server = local[0]) -> None:
                        if done >= len(texts) // 3 and not fired.is_set():
                            fired.set()
                            victim.kill()
                    run = run_workload(targets["router"], model, texts, tenants, args.concurrency, args.max_tokens,
                                       on_progress=progress)
                    row = summarize("router, 1 killed", n, run, ideal)
                    rows.append(row)
                    print(f"  router, server 0 killed mid-run: {row['req_per_s']:.2f} req/s, failed {row['failed']} "
                          f"(cut mid-stream {row['cut_mid_stream']})", file=sys.stderr)
            finally:
                for p in routers + local + remote:
                    p.stop()
    finally:
        if store is not None:
            store.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    by_key = {(r["servers"], r["mode"]): r for r in rows}
    for r in rows:
        rr = by_key.get((r["servers"], "round-robin"))
        r["same_text_as_round_robin"] = rr is not None and r["texts"] == rr["texts"]
        r["hit_rate_vs_limit"] = round(r["hit_rate"] / r["hit_rate_limit"], 3) if r["hit_rate_limit"] else None
        r["req_per_s_vs_round_robin"] = round(r["req_per_s"] / rr["req_per_s"], 3) if rr else None
    machine = machine_note("every server, router and the store on this machine")
    if args.json:
        for r in rows:
            r.pop("texts")
        print(json.dumps({"runs": rows, "requests": args.requests, "documents": args.documents,
                          "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                          "document_tokens": len(tok(doc)["input_ids"]),
                          "model": args.model or "SmolLM2-135M-Instruct", "machine": machine}))
        return 0
    print(f"Scale-out: {args.requests} requests, {args.documents} tenants each with its own document "
          f"({len(tok(doc)['input_ids']):,} tokens), {args.concurrency} in flight, max_tokens={args.max_tokens}, "
          f"streamed")
    print(f"{'servers':>7} {'mode':<18} {'req/s':>7} {'vs rr':>6} {'hit rate':>8} {'limit':>7} {'vs lim':>6} "
          f"{'device':>7} {'host':>6} {'disk':>6} {'remote':>7} {'TTFT p50':>8} {'p99':>6} {'failed':>6} {'cut':>4}  "
          "same text")
    for r in rows:
        t = r["hit_tokens_by_tier"]
        print(f"{r['servers']:>7} {r['mode']:<18} {r['req_per_s']:>7.2f} {r['req_per_s_vs_round_robin'] or 0:>6.2f} "
              f"{r['hit_rate']:>8.1%} {r['hit_rate_limit']:>7.1%} {r['hit_rate_vs_limit'] or 0:>6.2f} "
              f"{t.get('device', 0):>7,} {t.get('host', 0):>6,} {t.get('disk', 0):>6,} {t.get('remote', 0):>7,} "
              f"{r['ttft_p50_s']:>8.2f} {r['ttft_p99_s']:>6.2f} {r['failed_before_answer']:>6} {r['cut_mid_stream']:>4}  "
              f"{'yes' if r['same_text_as_round_robin'] else 'NO'}")
    print(f"machine: {machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
