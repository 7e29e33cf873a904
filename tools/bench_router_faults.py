"""The router with one broken backend of two: how many requests still succeed, beside the all-good baseline.

Knows: how to start two real `tieredkv serve` processes (tools/bench_scaleout.py's Server), a
fault front (tools/fault_front.py: a real HTTP peer that passes requests to server B or answers
as a broken backend does) and a `tieredkv route` process in front of A and the front, one fresh
router per case; the workload; what to report.

Cases: "all good" (the router over A and B), then one per fault mode of the front over B --
garbage (a 200 whose body is not JSON, while /health says 200), garbage_stream (a 200 event
stream of garbage), error_500 (a plain-text 500). The workload: --requests distinct short
prompts, every other one streamed, --concurrency in flight, greedy, --max-tokens tokens.

    ok         requests answered 200 with a good completion (a stream: good chunks and [DONE])
    rate       ok / requests
    broken     answers the client got from the broken backend (must be 0: its garbage is refused)
    ejections  times the router ejected the broken backend, as its /health reports
    p50 / p99  request latency, client side (a retried request pays for the refused answer)
    readmit s  seconds from the front's recovery (mode back to pass) to the router's /health
               showing it up again (the router's --eject-cooldown, then a probe completion)

    python tools/bench_router_faults.py [--requests 100] [--concurrency 4] [--max-tokens 4]
                                        [--modes garbage,garbage_stream,error_500]
                                        [--eject-cooldown 1] [--model M] [--json]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import machine_note  # noqa: E402  (sibling scripts)
from bench_scaleout import Process, Server  # noqa: E402
from fault_front import FaultFront  # noqa: E402


class Router(Process):
    def __init__(self, backends: list[str], eject_cooldown: float) -> None:
        args = ["route", "--port", "0", "--log-level", "warning", "--health-interval", "0.5",
                "--eject-cooldown", str(eject_cooldown)]
        for b in backends:
            args += ["--backend", b]
        super().__init__(args)
        self.url = self.wait_line(r"routing on (http://\S+) ", 60)[1]

    def view(self, backend: str) -> dict:
        return next(b for b in httpx.get(f"{self.url}/health", timeout=30).json()["backends"] if b["url"] == backend)


def one(client: httpx.Client, model: str, i: int, max_tokens: int) -> tuple[bool, str, float]:
    """(a good answer, the backend that gave it, seconds)."""
    stream = i % 2 == 1
    body = {"model": model, "prompt": f"Request {i}: how long is the warranty of unit {i}?", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    t0 = time.perf_counter()
    try:
        if not stream:
            r = client.post("/v1/completions", json=body)
            doc = r.json() if r.status_code == 200 else {}
            ok = doc.get("object") == "text_completion" and isinstance(doc["choices"][0]["text"], str)
        else:
            with client.stream("POST", "/v1/completions", json=body) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")] if r.status_code == 200 else []
            chunks = [json.loads(e) for e in events[:-1]]
            ok = bool(events) and events[-1] == "[DONE]" and all("choices" in c for c in chunks)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return False, "", time.perf_counter() - t0
    return ok, r.headers.get("x-tieredkv-backend", ""), time.perf_counter() - t0


def run_case(name: str, router: Router, broken: str | None, model: str, args: argparse.Namespace) -> dict:
    with httpx.Client(base_url=router.url, timeout=300) as c, ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda i: one(c, model, i, args.max_tokens), range(args.requests)))
    lat = sorted(s for _, _, s in results)
    ok = sum(r[0] for r in results)
    row = {"case": name, "requests": args.requests, "ok": ok, "rate": ok / args.requests,
           "broken_answers": sum(1 for r in results if broken and r[1] == broken),
           "p50_ms": statistics.median(lat) * 1000, "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
           "ejections": None, "readmit_s": None}
    if broken:
        row["ejections"] = sum(router.view(broken)["ejections"].values())
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--modes", default="garbage,garbage_stream,error_500")
    ap.add_argument("--eject-cooldown", type=float, default=1.0, help="the router's --eject-cooldown")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    tmp = Path(tempfile.mkdtemp(prefix="tieredkv-router-faults-"))
    servers: list[Server] = []
    rows: list[dict] = []
    try:
        print("starting two servers", file=sys.stderr)
        servers = [Server(tmp / "a", args.model, None, kv_events=True), Server(tmp / "b", args.model, None, kv_events=True)]
        a, b = servers
        router = Router([a.url, b.url], args.eject_cooldown)
        try:
            rows.append(run_case("all good", router, None, a.model, args))
        finally:
            router.stop()
        for mode in modes:
            with FaultFront(b.url, mode=mode) as front:
                router = Router([a.url, front.url], args.eject_cooldown)
                try:
                    row = run_case(f"one {mode}", router, front.url, a.model, args)
                    front.mode = "pass"
                    t0 = time.monotonic()
                    while not router.view(front.url)["healthy"] and time.monotonic() - t0 < 120:
                        time.sleep(0.05)
                    row["readmit_s"] = time.monotonic() - t0 if router.view(front.url)["healthy"] else None
                    rows.append(row)
                finally:
                    router.stop()
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"rows": rows, "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
           "eject_cooldown_s": args.eject_cooldown, "machine": machine_note()}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'case':<22} {'ok':>9} {'rate':>7} {'broken':>7} {'eject':>6} {'p50 ms':>8} {'p99 ms':>8} {'readmit s':>10}")
    for r in rows:
        print(f"{r['case']:<22} {r['ok']:>4}/{r['requests']:<4} {r['rate']:>7.1%} {r['broken_answers']:>7} "
              f"{'-' if r['ejections'] is None else r['ejections']:>6} {r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} "
              f"{'-' if r['readmit_s'] is None else format(r['readmit_s'], '.1f'):>10}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
