"""TTFT of a hit held below the device under each restore policy, beside a cold miss, from every
source, and each source's first hit after a restart (bench_ttft's `--restore-policy` mode).

Knows: the rounds. Steady rows: on one engine per site (tools/ttft_sources.py: host and disk
share one; the store directly, each proxied link and the stalled store get one each, so each
learns its own link), per prefix length and round a cold miss (a fresh tenant, nothing can hit;
with the store answering), the device hit (the suffix alone: a split's floor), then the hit from
each source under each policy in turn -- load, recompute, auto (engine/restore_planner.py; the
policy is switched on one engine, so all three decide from the same figures, and their order
turns every round). A stalled source's timed hits run with its valkey-server SIGSTOPped. One
untimed warm-up round at the shortest length first (first-call costs, the prefill fit, each
source's restore rate). First rows: per source and length a new Engine on the same disk dir and
store (nothing learned: the engine's first request is that hit, under auto), then a cold miss of
the same length on it. Every request is prefix + a new 16-token suffix, `max_tokens=1`.
Doesn't know: the targets' arithmetic or the table (tools/ttft_policy_report.py), the sources'
placement (tools/ttft_sources.py).

    python tools/bench_ttft.py --restore-policy auto,load,recompute [--prefix-lengths 256,1024,2048]
        [--remote-mbit 5,30,100] [--sources host,disk,remote,link,stalled] [--remote-timeout 5]
        [--stall-guard 30] [--no-first] [--repeat 3] [--quick] [--json]
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prompts import SUFFIX_TOKENS, prose_ids  # noqa: E402  (sibling scripts)
from bench_report import machine_note
from ttft_policy_report import print_table, report_rows, summary
from ttft_sources import LOCAL, Site, Source, Stores, make_sites, place, place_first, store_prefixes
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from storage.config import CODECS, CacheConfig
from storage.remote.url import parse_remote_url

POLICIES = ("load", "recompute", "auto")
SOURCES = ("host", "disk", "remote", "link", "stalled")
DEFAULT_LENGTHS = "256,1024,2048"
DEFAULT_MBIT = "5,30,100"
QUICK_LENGTHS = "256"
QUICK_MBIT = "30"
QUICK_SOURCES = "host,disk,link,stalled"
# The operator ran a slow link with --remote-timeout 5: a 16-token block over 5 Mbit/s
# takes ~0.5 s, an MGET of 32 of them ~15 s (each recv() returns within milliseconds; the
# timeout bounds one recv). A stalled store holds a request this long per call on today's main.
REMOTE_TIMEOUT_S = 5.0
STALL_GUARD_S = 30.0


def add_arguments(ap) -> None:
    """The flags of this mode (bench_ttft's parser)."""
    ap.add_argument("--remote-mbit", default=None,
                    help=f"with --restore-policy: the remote store also behind a bandwidth-limited proxy "
                         f"(tools/throttle_proxy.py) at each of these rates in Mbit/s (default {DEFAULT_MBIT}; "
                         f"'' for none)")
    ap.add_argument("--sources", default=None,
                    help=f"with --restore-policy: a subset of {','.join(SOURCES)} (link: each --remote-mbit; "
                         "stalled: a valkey-server of its own, SIGSTOPped for each timed hit); default all")
    ap.add_argument("--remote-timeout", type=float, default=REMOTE_TIMEOUT_S,
                    help=f"with --restore-policy: the engines' remote_timeout_s (default {REMOTE_TIMEOUT_S:g})")
    ap.add_argument("--load-deadline-slack", type=float, default=None,
                    help="the engines' load_deadline_slack_s and probe_wait_slack_s (with --restore-policy default: the engine's; without, 600: "
                         "the rows time each restore path); "
                         "a large one keeps every load however slow the machine (tests of the bench itself)")
    ap.add_argument("--stall-guard", type=float, default=STALL_GUARD_S,
                    help="with --restore-policy: seconds after which a stalled store is resumed anyway, so a "
                         f"request stuck on it finishes (its sample is marked; default {STALL_GUARD_S:g})")
    ap.add_argument("--no-first", action="store_true",
                    help="with --restore-policy: skip each source's first hit after a restart")
    ap.add_argument("--quick", action="store_true",
                    help=f"with --restore-policy: a smoke run -- prefix {QUICK_LENGTHS}, 1 round, sources "
                         f"{QUICK_SOURCES}, link {QUICK_MBIT} Mbit/s (unless given)")
    ap.add_argument("--codec", default="zstd", help="with --restore-policy: the tiers' codec (zstd, raw, nibble or auto)")
    ap.add_argument("--device-memory", default="1GiB", help="each engine's device pool")
    ap.add_argument("--host-memory", default="1GiB", help="each engine's host tier")


def check_args(ap, args) -> None:
    args.policies = [p.strip() for p in args.restore_policy.split(",") if p.strip()]
    if not args.policies or any(p not in POLICIES for p in args.policies):
        ap.error(f"--restore-policy: expected a comma-separated subset of {','.join(POLICIES)}")
    mbit = args.remote_mbit if args.remote_mbit is not None else (QUICK_MBIT if args.quick else DEFAULT_MBIT)
    try:
        args.remote_mbit = [float(x) for x in mbit.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--remote-mbit: expected comma-separated rates, got {mbit!r}")
    if any(m <= 0 for m in args.remote_mbit):
        ap.error("--remote-mbit: expected positive rates")
    sources = args.sources or (QUICK_SOURCES if args.quick else ",".join(SOURCES))
    args.source_set = {s.strip() for s in sources.split(",") if s.strip()}
    if not args.source_set or args.source_set - set(SOURCES):
        ap.error(f"--sources: expected a comma-separated subset of {','.join(SOURCES)}")
    if args.no_remote:
        args.source_set -= {"remote", "link", "stalled"}
    if "link" not in args.source_set:
        args.remote_mbit = []
    args.direct = "remote" in args.source_set
    if args.quick:
        args.repeat = 1
    if args.repeat < 1:
        ap.error("--repeat: expected >= 1")
    if not (0 < args.remote_timeout <= 3600 and args.stall_guard > 0):
        ap.error("--remote-timeout: expected seconds in (0, 3600]; --stall-guard: seconds > 0")
    if args.codec not in CODECS:
        ap.error(f"--codec: expected one of {','.join(CODECS)}, got {args.codec!r}")


class PolicyBench:
    """One source on one engine: its samples, per (kind, prefix length, column). Main thread."""

    def __init__(self, engine: Engine, source: Source, site: Site, policies: tuple[str, ...], run: str) -> None:
        self.engine, self.source, self.site, self.policies, self.run = engine, source, site, policies, run
        self.params = SamplingParams(max_tokens=1)
        self._round = 0
        self.overhead_s = 0.0        # the fitted prefill's fixed cost a step, after the rounds (a split's floor)
        # (kind, n, column) -> [(ttft_s, recomputed hit tokens, hit tokens from the source's tier, guard fired)]
        self.samples: dict[tuple[str, int, str], list[tuple[float, int, int, bool]]] = {}
        # The same keys -> each sample's queue_s (submit -> admitted): a slow admission (a probe's
        # wait, back-pressure) and a slow prefill read apart (issue 27, run 5).
        self.queues: dict[tuple[str, int, str], list[float]] = {}

    def tenant(self, n: int) -> str:
        return tenant_of(self.run, n)

    def suffix(self) -> list[int]:
        return prose_ids(self.engine.tokenizer, SUFFIX_TOKENS, offset=37 * _next() + 5)

    def ask(self, prefix: list[int], tenant: str):
        return self.engine.generate(prefix + self.suffix(), self.params, tenant=tenant)

    def timed_hit(self, prefix: list[int], tenant: str):
        """The hit, with a stalled source's store SIGSTOPped for it. Returns (output, guard fired)."""
        stall = self.site.stall
        if stall is None:
            return self.ask(prefix, tenant), False
        fired = stall.fired
        with stall.stalled():
            out = self.ask(prefix, tenant)
        return out, stall.fired > fired

    def record(self, kind: str, n: int, column: str, out, guarded: bool = False) -> None:
        # A hit short of n tokens is recorded, not refused: the prefix was placed in its tier
        # (place() checked), and what did not come from it was a store that timed out or a load
        # the engine gave up at its deadline (engine/load_deadline.py) and computed -- the table
        # marks such samples "*".
        hit = out.usage.hit_tokens_by_tier[self.source.tier]
        self.samples.setdefault((kind, n, column), []).append(
            (out.metrics.ttft_s, out.metrics.recomputed_hit_tokens, hit, guarded))
        self.queues.setdefault((kind, n, column), []).append(out.metrics.queue_s)

    def miss(self, kind: str, n: int, prefix: list[int]) -> None:
        out = self.ask(prefix, f"pol-{self.run}-miss-{_next()}")
        if out.usage.prompt_cache_miss_tokens != n + SUFFIX_TOKENS:
            raise RuntimeError(f"the miss hit the cache: {out.usage}")
        self.record(kind, n, "miss", out)
        self.engine.drop_tier("device")         # the fresh tenant's pages: never written anywhere
        self.engine.drop_tier("host")

    def round(self, n: int) -> None:
        prefix, tenant = prose_ids(self.engine.tokenizer, n), self.tenant(n)
        self.miss("steady", n, prefix)
        # Untimed: the prefix into device pages (over a slow link recomputed, not loaded).
        self.engine.planner.policy = "recompute" if self.site.mbit else "load"
        self.ask(prefix, tenant)
        # The floor of any restore: the same prompt with its prefix already in device pages
        # (only the suffix is computed). No split can beat it.
        device = self.ask(prefix, tenant)
        if device.usage.hit_tokens_by_tier["device"] != n:
            raise RuntimeError(f"{self.source.label}: expected {n} device hit tokens, got {device.usage}")
        self.record("steady", n, "device", device)
        k = self._round % len(self.policies)
        self._round += 1
        settle = self.engine.config.remote_retry_s + 30 if self.site.stall is not None else 0.0
        for policy in self.policies[k:] + self.policies[:k]:
            place(self.engine, self.source, prefix, tenant, settle)
            self.engine.planner.policy = policy
            out, guarded = self.timed_hit(prefix, tenant)
            self.record("steady", n, policy, out, guarded)
        self.engine.planner.policy = "auto"
        self.engine.drop_tier("device")

    def clear(self) -> None:
        self.samples.clear()
        self.queues.clear()


_counter = [0]


def tenant_of(run: str, n: int) -> str:
    """The stored prefix's tenant: one per length, shared by every source of the run (the
    stores' copies are store_prefixes')."""
    return f"pol-{run}-{n}"


def _next() -> int:
    """Request numbers unique to the process: suffixes and fresh tenants never repeat."""
    _counter[0] += 1
    return _counter[0]


def steady(site: Site, engine: Engine, args, run: str) -> list[PolicyBench]:
    policies = tuple(p for p in POLICIES if p in args.policies)    # a fixed order for the table
    benches = [PolicyBench(engine, s, site, policies, run) for s in site.sources]
    for b in benches:                # warm-up (untimed)
        b.round(min(args.lengths))
        b.clear()
    for r in range(args.repeat):
        for n in args.lengths:
            for b in benches:
                b.round(n)
        print(f"{site.label}: round {r + 1}/{args.repeat}", file=sys.stderr)
    for b in benches:
        b.overhead_s = engine.prefill_model.snapshot().get("overhead_s") or 0.0
    if site.store_url is not None:
        engine.drop_tier("device")   # nothing for close's flush to send down (and over a link)
        engine.drop_tier("host")
    return benches


def first_hits(site: Site, source: Source, loaded, args, run: str) -> PolicyBench:
    """Per length: a new engine on the site's disk dir and store, its first request the hit
    (under auto), then a cold miss of the same length."""
    bench = PolicyBench(None, source, site, ("auto",), run)
    for n in args.lengths:
        with site.open(loaded) as engine:
            bench.engine = engine
            prefix = prose_ids(engine.tokenizer, n)
            place_first(engine, source, prefix, tenant_of(run, n))
            # What the planner has at start: the figures the first hit is planned from.
            site.first_cost_models.setdefault(source.label, {})[n] = engine.cache_status()["cost_model"]
            engine.planner.policy = "auto"
            hit, guarded = bench.timed_hit(prefix, tenant_of(run, n))
            bench.record("first", n, "auto", hit, guarded)
            engine.drop_tier("device")
            engine.drop_tier("host")
            bench.miss("first", n, prefix)
        bench.engine = None
        print(f"{source.label}: first hit after a restart, prefix {n}", file=sys.stderr)
    return bench


def run(args) -> dict:
    """Every site, every source, every prefix length, every policy, and the first hits."""
    run_id = uuid.uuid4().hex[:8]
    remote = bool(args.source_set & {"remote", "link"})
    stores = Stores(args.remote_url, remote, "stalled" in args.source_set)
    if args.remote_mbit and stores.url is not None and parse_remote_url(stores.url).cluster:
        stores.cleanup()
        raise SystemExit("--remote-mbit: the proxy fronts one node; give a standalone store's --remote-url")
    tmp = tempfile.mkdtemp(prefix="tieredkv-pol-")
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # finally blocks run: stores resumed
    sites: list[Site] = []
    benches: list[PolicyBench] = []
    cost_models: dict[str, dict] = {}
    try:
        sites = make_sites(args, stores, tmp)
        # The model, loaded once for every engine of the run.
        with Engine.from_pretrained(args.model, cache=CacheConfig(device_memory=args.device_memory, host_memory=0,
                                                                  disk_dir=None)) as probe:
            loaded, context = probe.loaded, probe.max_context
        if max(args.lengths) + SUFFIX_TOKENS >= context:
            raise SystemExit(f"--prefix-lengths: {max(args.lengths)} + a {SUFFIX_TOKENS}-token suffix do not fit "
                             f"the {context}-token context")
        prefixes = {tenant_of(run_id, n): prose_ids(loaded.tokenizer, n) for n in args.lengths}
        stored: set[str] = set()
        for site in sites:
            site.sources = tuple(s for s in site.sources if s.site != LOCAL or s.label in args.source_set)
            if not site.sources:
                continue
            if site.store_url is not None and site.store_url not in stored:
                stored.add(site.store_url)
                store_prefixes(loaded, site.store_url, prefixes, os.path.join(tmp, f"kv-placer-{len(stored)}"),
                               args.remote_timeout, args.device_memory)
            with site.open(loaded) as engine:
                done = steady(site, engine, args, run_id)
                cost_models[site.label] = engine.cache_status()["cost_model"]
            for b in done:      # a closed engine's pool and host slab are freed with it, not kept per site
                b.engine = None
            benches += done
            if not args.no_first:
                for source in site.sources:
                    benches.append(first_hits(site, source, loaded, args, run_id))
            site.close()
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for site in sites:
            site.close()
        stores.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = report_rows(benches, args.lengths)
    return {"mode": "restore_policy", "rows": rows, "summary": summary(rows), "repeat": args.repeat,
            "policies": [p for p in POLICIES if p in args.policies], "prefix_lengths": args.lengths,
            "codec": args.codec, "remote_mbit": args.remote_mbit, "remote_timeout_s": args.remote_timeout,
            "stall_guard_s": args.stall_guard, "sources": sorted(args.source_set),
            "stall_guard_fired": sum(s.stall.fired for s in sites if s.stall is not None),
            "cost_model": cost_models,
            "first_cost_model": {k: v for s in sites for k, v in s.first_cost_models.items()},
            "machine": machine_note()}


def main(ap, args) -> int:
    check_args(ap, args)
    logging.basicConfig(level=logging.WARNING)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0
