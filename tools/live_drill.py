"""Live drill: issue 28's attack matrix against a real `tieredkv serve` process under load.

Knows: how to start the server (a subprocess on loopback, its own cache dir, a tiny random-weight
Llama with the real tokenizer unless --model), how to load it (--clients threads sending greedy
completions whose prompts share long prefixes; each answer compared with the same prompt's answer
from a healthy pass at the start: a differing answer is a wrong answer), each attack, and what to
count. Doesn't know: why the server does what it does (the rows only count outcomes).

Disk attacks, each --trials times on one server under load (per trial: flush every block to disk,
drop the device and host tiers so requests restore from disk, attack data.mdb, poll the health
routes for --poll-s, then drop the upper tiers again, load, flush, and read the disk tier's blocks):
    truncate   data.mdb cut to a random length          garbage    a random range overwritten
    zero_meta  both meta pages zeroed                    unlink     data.mdb unlinked
    control    no attack (what the load alone gives: the rows' baseline)
Counted: crashes (the process exited; restarted on the same dir), wrong answers, failed requests
(non-200 by status; `conn` a refused or cut connection; timeouts apart), health-route 5xx other
than /ready's 503 (GET /ready, /health, /v1/cache/status, POST /v1/cache/flush, polled during and
after), trials whose disk tier holds blocks again after the flush ("came back"), and at the row's
end a SIGTERM: its exit status, "Application shutdown failed" in its log, and a restart on the same
dir (ready, disk blocks, one request).
Other rows: read_only (cache dir on a tmpfs remounted read-only: does it start, what /ready says,
requests served), disconnect (--closers streams closed after their first chunk: requests still in
flight 5 s later, the abort metric), tenant_flood (tenant A's 200 streams never read; tenant B's
requests: status and latency), full_fs_bills (a 48 MiB tmpfs filled to the last byte while
requests are served, SIGTERM, restart: served vs billed), tiny_disk_flush (an 8 MiB tmpfs: what
flush answers against what the disk holds). The tmpfs rows need root (skipped, and said, if not).

    python tools/live_drill.py [--trials 6] [--quick] [--model DIR] [--only ROWS] [--json]

The server is tools/live_server.py's (faulthandler on: a crash's JSON keeps the stack that touched
the bad page); the rows that are not disk damage are tools/live_drill_rows.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # the sibling scripts (tools/ is not a package)
from live_drill_rows import OtherRows  # noqa: E402
from live_server import TIMEOUT, Server, Tally, prompts, tiny_model  # noqa: E402

DISK_ATTACKS = ("control", "truncate", "garbage", "zero_meta", "unlink")
HEALTH = (("GET", "/ready"), ("GET", "/health"), ("GET", "/v1/cache/status"), ("POST", "/v1/cache/flush"))


class Load:
    """--clients threads, each sending greedy completions of random prompts while the row runs;
    paused while the server restarts."""

    def __init__(self, drill: "Drill", tally: Tally, clients: int) -> None:
        self.drill, self.tally = drill, tally
        self.stop, self.running = threading.Event(), threading.Event()
        self.running.set()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            self.running.wait()
            p = rng.choice(self.drill.prompts)
            try:
                r = self.drill.server.call("POST", "/v1/completions", self.drill.body(p))
            except httpx.TimeoutException:
                self.tally.add("timeouts")
                continue
            except httpx.TransportError:
                if self.running.is_set():
                    self.tally.add("failed", sub="conn")
                time.sleep(0.2)
                continue
            if r.status_code != 200:
                self.tally.add("failed", sub=str(r.status_code))
            elif (got := r.json()["choices"][0]["text"]) != self.drill.expected[p]:
                self.tally.add("wrong")
                self.tally.row["other"].append(f"wrong: prompt {self.drill.prompts.index(p)} {got!r}, "
                                               f"expected {self.drill.expected[p]!r}")
            else:
                self.tally.add("ok")

    def close(self) -> None:
        self.stop.set()
        self.running.set()
        for t in self.threads:
            t.join(TIMEOUT + 10)


def attack(path: Path, kind: str, rng: random.Random) -> str:
    size = path.stat().st_size
    if kind == "truncate":
        n = rng.randrange(0, size)
        os.truncate(path, n)
        return f"to {n} of {size} B"
    if kind == "garbage":
        at = rng.randrange(0, size)
        n = rng.randrange(1, min(size - at, 256 << 10) + 1)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(os.urandom(n))
        return f"{n} B at {at}"
    if kind == "zero_meta":
        with open(path, "r+b") as f:
            f.write(bytes(2 * 4096))
        return "pages 0-1"
    if kind == "unlink":
        path.unlink()
        return "unlinked"
    return "none"


class Drill(OtherRows):
    """The drill's state: its work dir, the model, the server now running, the expected answers.
    Owned by the main thread; the load threads read server and expected."""

    def __init__(self, args, work: Path) -> None:
        self.args, self.work = args, work
        self.model = args.model or tiny_model(work / "tiny")
        self.prompts = prompts()
        self.server: Server | None = None
        self.name = "?"
        self.expected: dict[str, str] = {}
        self.mounts: list[Path] = []

    def body(self, prompt: str, **kw) -> dict:
        return {"model": self.name, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}

    def start(self, cache_dir: Path, *extra: str) -> Server:
        self.server = Server(self.model, cache_dir, *extra)
        self.name = self.server.call("GET", "/v1/models").json()["data"][0]["id"]
        return self.server

    def healthy_pass(self) -> None:
        """The expected answers: each prompt once, one at a time, on a fresh server (no damage)."""
        srv = self.start(self.work / "healthy")
        for p in self.prompts:
            r = srv.call("POST", "/v1/completions", self.body(p))
            r.raise_for_status()
            self.expected[p] = r.json()["choices"][0]["text"]
        srv.sigterm()

    def poll_health(self, tally: Tally, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.server.alive():
            for method, path in HEALTH:
                try:
                    r = self.server.call(method, path, {} if method == "POST" else None)
                except httpx.TimeoutException:
                    tally.row["other"].append(f"{path} timed out")
                    continue
                except httpx.TransportError:
                    continue                               # the process is gone: counted as a crash
                if r.status_code == 503 and path == "/ready":
                    tally.add("ready_503")
                elif r.status_code >= 500:
                    tally.add("health_5xx", sub=f"{method} {path} {r.status_code}")
            time.sleep(0.2)

    def disk_row(self, kind: str, trials: int, seed: int) -> dict:
        rng, tally = random.Random(seed), Tally(kind)
        cache = self.work / f"cache-{kind}"
        self.start(cache)
        load = Load(self, tally, self.args.clients)
        notes = []
        for t in range(trials):
            tally.add("trials")
            try:
                self.server.call("POST", "/v1/cache/flush", {})
                for tier in ("device", "host"):
                    self.server.call("POST", "/v1/cache/flush", {"tier": tier})
                time.sleep(1.0)                            # requests restore from disk now
                data = cache / "kv" / "data.mdb"
                notes.append(attack(data, kind, rng) if data.exists() else "no data.mdb")
            except (httpx.HTTPError, OSError) as e:
                notes.append(f"prime failed: {type(e).__name__}")
            self.poll_health(tally, self.args.poll_s)
            if not self.server.alive():
                tally.add("crashes")
                rc = self.server.proc.returncode
                tally.row["other"].append(f"trial {t} ({notes[-1]}): exit {rc}"
                                          + (f" ({signal.Signals(-rc).name})" if rc < 0 else ""))
                tally.row.setdefault("crash_logs", []).append(self.server.errors())
                load.running.clear()
                self.start(cache)
                load.running.set()
            try:
                for tier in ("device", "host"):
                    self.server.call("POST", "/v1/cache/flush", {"tier": tier})
                time.sleep(self.args.poll_s)
                self.poll_health(tally, 1.0)
                flushed = self.server.call("POST", "/v1/cache/flush", {})
                blocks = flushed.json()["cache"]["tiers"]["disk"]["blocks"] if flushed.status_code == 200 else 0
                tally.add("came_back", int(blocks > 0))
            except httpx.HTTPError as e:
                tally.row["other"].append(f"trial {t}: after-check {type(e).__name__}")
        load.close()
        status = self.server.call("GET", "/v1/cache/status").json()["tiers"]["disk"]
        before, why = status["blocks"], re.sub(r"\S*/", "", (status["recovered"] or "").split(": ", 1)[-1])[:90]
        # A truncate inside a transaction (after the files' check): read as zeros, not a SIGBUS
        # (storage/disk/map_faults.py); the replacement's log line says so.
        absorbed = sum("damaged while in use" in ln and "absorbed as zeros" in ln for ln in self.server.log().splitlines())
        tally.row["other"].append(f"disk hits {status['hits']}, moved aside {status['moved_aside']}"
                                  f" ({absorbed} after a fault absorbed inside a transaction)"
                                  + (f" (last: {why})" if why else ""))
        down = self.server.sigterm()
        tally.row["errors"] = self.server.errors()
        again = self.start(cache)
        ready = again.call("GET", "/ready")
        after = again.call("GET", "/v1/cache/status").json()["tiers"]["disk"]["blocks"]
        one = again.call("POST", "/v1/completions", self.body(self.prompts[0])).status_code
        again.sigterm()
        tally.row["shutdown"] = down
        tally.row["other"].append(f"SIGTERM exit {down['rc']}, shutdown failed: {down['shutdown_failed']}; restart: "
                                  f"/ready {ready.status_code}, {after} disk blocks (had {before}), request {one}")
        tally.row["attacks"] = notes
        return tally.row

    def cleanup(self) -> None:
        if self.server is not None and self.server.alive():
            self.server.kill()
        for mnt in self.mounts:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def print_table(result: dict) -> None:
    print("| attack | trials | crashes | wrong answers | failed requests | health 500s | other outcome |")
    print("|---|---:|---:|---:|---|---|---|")
    for r in result["rows"]:
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(r["failed"].items())) or "0"
        if r["timeouts"]:
            failed += f" (+{r['timeouts']} timed out)"
        h5 = ", ".join(f"{k}: {v}" for k, v in sorted(r["health_5xx"].items())) or "0"
        other = "; ".join(r["other"])
        if r["attack"] in DISK_ATTACKS:
            other = (f"{r['ok']} answers right; tier back {r['came_back']}/{r['trials']}; /ready 503 polls "
                     f"{r['ready_503']}; " + other)
        else:
            other = f"{r['ok']} answered 200; " + other
        print(f"| {r['attack']} | {r['trials']} | {r['crashes']} | {r['wrong']} | {failed} | {h5} | {other} |")
    print(f"\n{result['seconds']:.0f} s; {result['machine']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=6, help="trials per disk attack (default 6)")
    ap.add_argument("--quick", action="store_true", help="2 trials per disk attack")
    ap.add_argument("--model", default=None, help="a model for `serve --model` (default: a tiny random-weight Llama)")
    ap.add_argument("--clients", type=int, default=3, help="load threads during the disk attacks")
    ap.add_argument("--closers", type=int, default=60, help="streams that close after their first chunk")
    ap.add_argument("--poll-s", type=float, default=3.0, help="seconds of health polls after each attack")
    ap.add_argument("--only", default="", help="comma-separated rows: " + ",".join(DISK_ATTACKS)
                    + ",read_only,disconnect,tenant_flood,full_fs_bills,tiny_disk_flush")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trials = 2 if args.quick else args.trials
    only = set(filter(None, args.only.split(",")))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="live-drill-") as tmp:
        drill = Drill(args, Path(tmp))
        rows = []
        try:
            drill.healthy_pass()
            for i, kind in enumerate(DISK_ATTACKS):
                if not only or kind in only:
                    rows.append(drill.disk_row(kind, trials, args.seed + i))
            for name, fn in (("read_only", drill.read_only_row), ("disconnect", lambda: drill.disconnect_row(args.closers)),
                             ("tenant_flood", drill.tenant_flood_row), ("full_fs_bills", drill.full_fs_bills_row),
                             ("tiny_disk_flush", drill.tiny_disk_flush_row)):
                if not only or name in only:
                    rows.append(fn())
        finally:
            drill.cleanup()
    from bench_report import emit, machine_note
    result = {"rows": rows, "seconds": time.monotonic() - started, "config": {"trials": trials, **vars(args)},
              "machine": machine_note()}
    emit(json.loads(json.dumps(result, default=str)), args.json, print_table)


if __name__ == "__main__":
    main()
