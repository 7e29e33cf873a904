"""The rows of tools/live_drill.py that are not live disk damage (issue 28, items 3, 4, 6, 7, 8).

Knows: each row's setup (a tmpfs where it needs one: root), its clients and what it reports.
Doesn't know: the server's command line (tools/live_server.py) or the disk attacks.
Mixed into live_drill.Drill: uses its start(), server, body(), poll_health() and work dir.
"""
from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from live_server import TIMEOUT, WORDS, Server, Tally


class OtherRows:
    def mount(self, size: str, read_only: bool = False) -> Path | None:
        mnt = self.work / f"fs-{len(self.mounts)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True).returncode != 0:
            return None
        self.mounts.append(mnt)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        return mnt

    def statuses(self, n: int, tag: str, **kw) -> Counter:
        got: Counter = Counter()
        for i in range(n):
            try:
                got[self.server.call("POST", "/v1/completions", self.body(f"{tag} request {i} " * 6, **kw)).status_code] += 1
            except httpx.TimeoutException:
                got["timeout"] += 1
        return got

    def read_only_row(self) -> dict:
        tally = Tally("read_only cache dir at start")
        tally.add("trials")
        mnt = self.mount("1m", read_only=True)
        if mnt is None:
            return {**tally.row, "other": ["skipped: cannot mount a tmpfs (needs root)"]}
        try:
            self.start(mnt)
        except RuntimeError as e:
            tally.row["other"].append(f"did not start: {str(e)[-300:]}")
            return tally.row
        ready = self.server.call("GET", "/ready")
        got = self.statuses(5, "read-only")
        tally.row["failed"].update({str(k): v for k, v in got.items() if k != 200})
        tally.add("ok", got[200])
        later = self.server.call("GET", "/ready").json()["billing"]
        self.poll_health(tally, 1.0)
        down = self.server.sigterm()
        r, logged = ready.json(), self.server.log().count("billing: unwritten ")
        tally.row["other"].append(f"started; /ready {ready.status_code} disk={r['tiers']['disk']!r} reasons={r['reasons']}; "
                                  f"bills unwritten after the requests {later['unwritten']}; SIGTERM exit {down['rc']}, "
                                  f"bills left in its log {logged}")
        return tally.row

    def disconnect_row(self, closers: int) -> dict:
        tally = Tally(f"{closers} streams closed after the first chunk")
        tally.add("trials")
        srv = self.start(self.work / "cache-disconnect")
        before = aborted(srv)

        def one(i: int) -> None:
            body = self.body(f"closer {i}: tell a long story", max_tokens=1500, ignore_eos=True, stream=True,
                             user=f"closer-{i % 4}")
            try:
                with httpx.Client(timeout=TIMEOUT) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        tally.add("failed", sub=str(r.status_code))
                        return
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                            tally.add("ok")
                            return                      # the client hangs up here
            except httpx.TimeoutException:
                tally.add("timeouts")
        threads = [threading.Thread(target=one, args=(i,)) for i in range(closers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(5)
        in_flight = srv.call("GET", "/health").json()["in_flight"]
        delta = aborted(srv) - before
        self.poll_health(tally, 1.0)
        down = srv.sigterm()
        tally.row["other"].append(f"in flight 5 s after the last close: {in_flight} (was 31 of 200); "
                                  f"aborted metric +{delta:.0f}; SIGTERM exit {down['rc']}")
        return tally.row

    def tenant_flood_row(self, streams: int = 200) -> dict:
        tally = Tally(f"tenant A {streams} unread streams vs tenant B")
        tally.add("trials")
        srv, socks, lat = self.start(self.work / "cache-flood"), [], []
        host, port = srv.url.removeprefix("http://").split(":")
        for i in range(8):                                # B: 3 requests before the flood, 5 under it
            if i == 3:
                for j in range(streams):                  # A: sent, never read
                    body = json.dumps(self.body(f"A {j}: a very long story", max_tokens=1000, ignore_eos=True,
                                                stream=True, user="tenant-a")).encode()
                    socks.append(socket.create_connection((host, int(port))))
                    socks[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Type: application/json"
                                      b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(3)
            t0 = time.monotonic()
            got = self.statuses(1, f"B {i}", max_tokens=3, user="tenant-b")
            lat.append(time.monotonic() - t0)
            tally.add("ok", got[200])
            tally.row["failed"].update({str(k): v for k, v in got.items() if k != 200})
        a: Counter = Counter()
        for s in socks:
            s.settimeout(10)
            try:
                a[s.recv(16).split(b" ")[1].decode()] += 1
            except (OSError, IndexError):
                a["no answer"] += 1
            s.close()
        self.poll_health(tally, 1.0)
        down = srv.sigterm()
        tally.row["other"].append(f"B's 3-token requests: alone {max(lat[:3]):.2f} s at most, under the flood "
                                  f"{', '.join(f'{x:.2f}' for x in lat[3:])} s (was: timed out at 120 s, then 58 s); "
                                  f"A answered {dict(a)}; SIGTERM exit {down['rc']}")
        return tally.row

    def full_fs_bills_row(self) -> dict:
        from tests.engine.test_billing_full_disk import fill
        tally = Tally("bills at SIGTERM on a full tmpfs")
        tally.add("trials")
        mnt = self.mount("48m")
        if mnt is None:
            return {**tally.row, "other": ["skipped: cannot mount a tmpfs (needs root)"]}
        self.start(mnt / "cache")
        got = self.statuses(5, "before")
        fillers = []
        for i in range(30):
            fillers.append(fill(mnt))                     # to the last byte, again and again
            got += self.statuses(1, f"full {i}")
        ready = self.server.call("GET", "/ready")
        self.poll_health(tally, 1.0)
        down = self.server.sigterm()
        for f in fillers:
            f.unlink()
        again = self.start(mnt / "cache")
        billed = again.call("GET", "/v1/cache/billing").json()["total"]["requests"]
        again.sigterm()
        tally.add("ok", got[200])
        tally.row["failed"].update({str(k): v for k, v in got.items() if k != 200})
        tally.row["other"].append(f"served {got[200]}, billed after restart {billed} (was 101 of 110); /ready while "
                                  f"full {ready.status_code}, unwritten {ready.json()['billing']['unwritten']}; "
                                  f"SIGTERM exit {down['rc']}, shutdown failed: {down['shutdown_failed']}")
        return tally.row

    def tiny_disk_flush_row(self) -> dict:
        tally = Tally("flush on an 8 MiB tmpfs")
        tally.add("trials")
        mnt = self.mount("8m")
        if mnt is None:
            return {**tally.row, "other": ["skipped: cannot mount a tmpfs (needs root)"]}
        self.start(mnt / "cache")
        rng = random.Random(6)
        for i in range(60):                                # ~60 x 62 blocks: several times the disk
            r = self.server.call("POST", "/v1/completions",
                                 self.body(f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(950)), max_tokens=2))
            tally.add("ok") if r.status_code == 200 else tally.add("failed", sub=str(r.status_code))
        f = self.server.call("POST", "/v1/cache/flush", {})
        self.poll_health(tally, 1.0)
        ans = f.json() if f.status_code == 200 else {}
        disk = self.server.call("GET", "/v1/cache/status").json()["tiers"]["disk"]
        down = self.server.sigterm()
        true = ans.get("complete") is False or ans.get("held") == ans.get("blocks") <= disk["blocks"]
        tally.row["other"].append(f"flush {f.status_code}: written {ans.get('written')}, complete {ans.get('complete')}, "
                                  f"held {ans.get('held')} of {ans.get('blocks')}, evicted {ans.get('evicted')}; disk "
                                  f"holds {disk['blocks']}: answer {'true' if true else 'FALSE'} (was complete with 0 "
                                  f"held); SIGTERM exit {down['rc']}")
        return tally.row


def aborted(srv: Server) -> float:
    m = re.search(r'^tieredkv_requests_aborted_total{reason="client_disconnected"} (\S+)$',
                  srv.call("GET", "/metrics").text, re.M)
    return float(m[1]) if m else 0.0
