"""Issue 29's figures, each beside its limit measured in the same run: an exact repeat computes
nothing, and n choices cost one prefill.

    row            what is timed (median over --repeat rounds)            limit
    exact/device   TTFT of the README's 113-token prompt, repeated        0.2x the TTFT of the same prompt
                   (every token and its stored logits on the device)      with another last token (a device
                                                                          hit computing one token)
    exact/host     the same after demote("device")                        0.5x that one-token device hit
    exact/disk     after demote("device"), demote("host"), disk.drain()   0.5x likewise
    n=8            one request, n=8, --n-prompt tokens of prose,          total <= 0.3x eight separate
                   max_tokens --n-max-tokens, on a cold cache             requests (submitted together,
                   (a fresh tenant)                                       each its own tenant: no sharing);
                                                                          TTFT <= 1.2x one n=1 request
Beside them: prompt tokens computed (the runner's counter) and device pages in use at the
peak of the n=8 request vs the eight, and the exact repeat's TTFT with exact hits off (before).

    python tools/bench_exact.py [--repeat 5] [--n-prompt 1024] [--n-max-tokens 16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_prompts import prose_ids  # noqa: E402  (sibling scripts)
from bench_report import machine_note  # noqa: E402

from tieredkv import CacheConfig, Engine, SamplingParams  # noqa: E402

MANUAL = ("You are the support assistant for the Halden H2 home battery. Answer in one sentence. "
          "The warranty lasts ten years or 6,000 full cycles, whichever comes first, and covers the "
          "cells, the inverter and the battery management system. Error E04 means the battery is too "
          "cold to charge: it stops charging below 0 degrees Celsius and resumes above 5 degrees. "
          "Error E07 means the grid connection was lost; the battery keeps the house powered for up "
          "to ten hours. ")
PROMPT = MANUAL + "Question: how long is the warranty? Answer:"      # the README's example


def _engine(root: str, exact: bool) -> Engine:
    cache = CacheConfig(block_size=16, device_memory="512MiB", host_memory="1GiB",
                        disk_dir=os.path.join(root, "kv"), disk_capacity="4GiB")
    return Engine.from_pretrained(None, cache, exact_hits=exact, max_n=16)


def _ttft(eng: Engine, ids: list[int], tenant: str) -> tuple[float, object]:
    out = eng.generate(ids, SamplingParams(max_tokens=1), tenant=tenant)
    return out.metrics.ttft_s, out.usage


def exact_rows(eng: Engine, repeat: int) -> dict:
    ids = eng.encode(PROMPT)
    t: dict[str, list[float]] = {k: [] for k in ("one_token_device", "device", "host", "disk", "off_device")}
    computed: dict[str, int] = {}
    for r in range(repeat):
        tenant = f"exact-{uuid.uuid4().hex[:8]}"
        _ttft(eng, ids, tenant)            # cold: stores the blocks and the exact entry
        # The same prompt with a last token never sent before: a device hit computing one token.
        other = ids[:-1] + [1000 + r]
        s, usage = _ttft(eng, other, tenant)
        assert usage.prompt_cache_miss_tokens == 1, usage
        t["one_token_device"].append(s)
        for tier in ("device", "host", "disk"):
            if tier in ("host", "disk"):
                eng.cache.demote("device")
            if tier == "disk":
                eng.cache.demote("host")
                eng.cache.disk.drain()
            before = eng.runner.tokens_computed
            s, usage = _ttft(eng, ids, tenant)
            assert usage.hit_tokens_by_tier[tier] == len(ids), usage
            computed[tier] = eng.runner.tokens_computed - before
            t[tier].append(s)
    return {"prompt_tokens": len(ids), "ttft_s": {k: statistics.median(v) for k, v in t.items() if v},
            "prompt_tokens_computed": computed}


def n_rows(eng: Engine, n_prompt: int, max_tokens: int, repeat: int) -> dict:
    ids = prose_ids(eng.tokenizer, n_prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=True)
    res: dict[str, list[float]] = {"n8_total": [], "n8_ttft": [], "n1_ttft": [], "eight_total": []}
    tokens, peak = {}, {}

    def watch_peak(stop: threading.Event, out: list[int]) -> None:
        while not stop.is_set():
            out[0] = max(out[0], eng.cache.pool.stats().in_use_pages)
            time.sleep(0.0005)

    def timed(key: str, fn) -> None:
        stop, top = threading.Event(), [0]
        w = threading.Thread(target=watch_peak, args=(stop, top))
        w.start()
        before = eng.runner.tokens_computed
        t0 = time.perf_counter()
        outs = fn()
        res[key].append(time.perf_counter() - t0)
        stop.set()
        w.join()
        tokens[key], peak[key] = eng.runner.tokens_computed - before, top[0]
        return outs

    for _ in range(repeat):
        run = uuid.uuid4().hex[:8]
        outs = timed("n8_total", lambda: eng.generate(ids, SamplingParams(**{**params.__dict__, "n": 8}),
                                                      tenant=f"n8-{run}"))
        res["n8_ttft"].append(outs[0].metrics.ttft_s)
        one = eng.generate(ids, params, tenant=f"n1-{run}")
        res["n1_ttft"].append(one.metrics.ttft_s)
        # Eight separate requests at once, each its own tenant: nothing shared (no prefix hits).
        outs8: list = [None] * 8

        def eight() -> list:
            threads = [threading.Thread(target=lambda i=i: outs8.__setitem__(
                i, eng.generate(ids, params, tenant=f"sep{i}-{run}"))) for i in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return outs8
        timed("eight_total", eight)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"prompt_tokens": len(ids), "max_tokens": max_tokens, "seconds": med,
            "tokens_computed": tokens, "peak_pages_in_use": {"n8_total": peak["n8_total"],
                                                             "eight_total": peak["eight_total"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=1024)
    ap.add_argument("--n-max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as root:
        with _engine(os.path.join(root, "off"), exact=False) as off:
            ids = off.encode(PROMPT)
            _ttft(off, ids, "warm")
            before = statistics.median(_ttft(off, ids, "warm")[0] for _ in range(args.repeat))
        with _engine(os.path.join(root, "on"), exact=True) as eng:
            exact = exact_rows(eng, args.repeat)
            exact["ttft_s"]["off_device"] = before
            n = n_rows(eng, args.n_prompt, args.n_max_tokens, max(1, args.repeat // 2))
    one = exact["ttft_s"]["one_token_device"]
    rows = [("exact/device", exact["ttft_s"]["device"], 0.2 * one),
            ("exact/host", exact["ttft_s"]["host"], 0.5 * one),
            ("exact/disk", exact["ttft_s"]["disk"], 0.5 * one),
            ("n=8 total", n["seconds"]["n8_total"], 0.3 * n["seconds"]["eight_total"]),
            ("n=8 TTFT", n["seconds"]["n8_ttft"], 1.2 * n["seconds"]["n1_ttft"])]
    report = {"exact": exact, "n": n, "rows": [{"row": r, "seconds": s, "limit_s": lim, "ok": s <= lim}
                                               for r, s, lim in rows], "machine": machine_note()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{'row':14} {'measured':>10} {'limit':>10}  ok")
    for r, s, lim in rows:
        print(f"{r:14} {s * 1e3:8.1f}ms {lim * 1e3:8.1f}ms  {'yes' if s <= lim else 'NO'}")
    print(f"README prompt ({exact['prompt_tokens']} tokens): exact repeat from the device "
          f"{exact['ttft_s']['device'] * 1e3:.1f} ms; with exact hits off (1 token computed) "
          f"{before * 1e3:.1f} ms; one-token device hit {one * 1e3:.1f} ms; prompt tokens computed on "
          f"the exact hits {exact['prompt_tokens_computed']}")
    print(f"n=8 vs 8 separate ({n['prompt_tokens']} prompt tokens, {n['max_tokens']} out): tokens computed "
          f"{n['tokens_computed']}, peak pages in use {n['peak_pages_in_use']}, seconds "
          f"{ {k: round(v, 3) for k, v in n['seconds'].items()} }")
    print(machine_note())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
