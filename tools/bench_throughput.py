"""Throughput against prefix hit rate: the seed experiment of the prefix-caching literature.

Knows: how to build the workload -- N prompts of L tokens, M output tokens each; at hit rate r
the first r*L tokens (rounded to whole blocks) of every prompt are a prefix shared with a
warm-up prompt run before the timed window, the rest is unique to the prompt -- and how to
time the same workload on four systems:

    tieredkv                 Engine with all three tiers (device pool, host, disk in a temp
                             dir); the warm-up prompt is served first, untimed.
    tieredkv_nocache         the cache disabled as far as the engine allows: a second Engine on
                             the same weights with no host and no disk tier, and a new tenant
                             per request (isolate_tenants), so no block can hit and every
                             prompt token is computed. (The paged pool stays: it is where the
                             engine keeps KV while it runs.)
    transformers_generate    a separate plain copy of the model (SDPA), `model.generate` on all
                             N prompts as one batch (equal lengths: no padding), greedy.
    transformers_batch       the same copy, transformers' continuous batching
                             `model.generate_batch(inputs, generation_config,
                             persistent_manager=True)`, greedy; its manager is built in the
                             untimed warm-up (a fresh one costs seconds per call on CPU).
                             Its own prefix sharing (allow_block_sharing) stays on, as shipped,
                             and it is served the same untimed warm-up prompt as tieredkv before
                             each timed batch, so whatever it can reuse across calls it may.
                             It runs at every hit rate (the peer's curve beside ours), and what
                             it reuses is measured: the "peer hit" column counts the prompt
                             tokens its prefix match returned (PagedAttentionCache.
                             search_prefix_match, wrapped). What it reuses: full pages
                             (page_size tokens, 256 by default; --peer-page-size) of a prefix
                             it computed earlier in the same persistent manager -- the warm-up
                             prompt's pages survive the call as unreferenced "cached blocks"
                             until the pool needs room. What it does not: a prefix shorter
                             than a page, the tail of a prefix past its last full page, blocks
                             it evicted (all cached blocks go at once under memory pressure),
                             anything across processes or restarts (no host or disk tier), and
                             pages of requests admitted in the same step (a page is matchable
                             only after the forward that completed it).

Every request produces exactly M tokens (ignore_eos / no eos). Requests/s = N / wall time of
the whole batch (all N submitted at once). Each engine run starts from an empty cache (all
tiers dropped) so a run never pays for demoting the previous run's blocks; the cost of
demotion is the tier-edges benchmark's subject. The no-cache system and transformers' generate
compute every token at every hit rate, so by default they run at 0% only (--baseline-rates);
transformers' continuous batching runs at every rate (--peer-rates).

Targets: at 0% the cache costs <= 2% throughput (tieredkv vs tieredkv_nocache); at 100%
tieredkv does >= 4.8x its 0% figure (L=1024, M=8); at 0% tieredkv is not slower than
transformers' own batching, and at every hit rate tieredkv >= transformers_batch (the ratio per
rate). Each is judged by the median wall-clock req/s (its definition)
and, beside it, by the best run's wall clock and by requests per CPU-second of this process:
on a machine shared with other jobs identical runs differ by tens of percent in wall time,
while the best run and CPU time move far less (see targets()). The 0% runs, where the
targets compare systems, are repeated --repeat-zero times with the order of systems
alternating, so a burst of outside load does not land on one system only.

    python tools/bench_throughput.py [--n 4] [--length 1024] [--max-tokens 8]
        [--rates 0,0.1,...,1] [--baseline-rates 0] [--repeat 1] [--repeat-zero 2] [--json]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note, on_limit_thread  # noqa: E402  (sibling scripts, not a package)
from bench_prompts import prose_ids  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402

SYSTEMS = ("tieredkv", "tieredkv_nocache", "transformers_generate", "transformers_batch")
DEFAULT_RATES = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1"


class Workload:
    """Prompts for one hit rate. Every unique part opens with its own numbered line (then prose),
    so its first block differs from every other prompt's in this run and in earlier runs --
    for our block hashes and for transformers' own prefix sharing alike."""

    def __init__(self, tokenizer, n: int, length: int, rate: float, block_size: int, salt: int) -> None:
        self.shared = min(length, int(round(rate * length / block_size)) * block_size)
        self.rate = rate
        prefix = prose_ids(tokenizer, self.shared, offset=0)

        def unique(tag: str, size: int, offset: int) -> list[int]:
            head = tokenizer(f"{tag}, run {salt}.\n")["input_ids"][:size]
            return head + prose_ids(tokenizer, size - len(head), offset=offset)

        tail = length - self.shared
        self.prompts = [prefix + unique(f"Request {i}", tail, 131 * (i + 1)) for i in range(n)]
        self.warm = prefix + unique("Warm-up", block_size, 0) if self.shared else None


def _check_lengths(outs_tokens: list[list[int]], m: int, system: str) -> None:
    bad = [len(t) for t in outs_tokens if len(t) != m]
    if bad:
        raise RuntimeError(f"{system}: expected {m} output tokens per request, got {bad}")


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    cpu_s: float          # this process's CPU time (all threads) over the same window
    hit_tokens: int
    prompt_tokens: int


class _Clock:
    """Wall and process CPU time of a `with` block. CPU time is the load-robust companion of
    wall time on a shared machine: other processes' work lengthens our wall time, not our
    CPU time (mostly: OpenMP threads spin a little while they wait for a preempted peer)."""

    def __enter__(self) -> "_Clock":
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


class _PeerHits:
    """Prompt tokens transformers' continuous batching took from its own cache during a `with`
    block: the return value of PagedAttentionCache.search_prefix_match (matched tokens, whole
    pages), counted by wrapping it. 0 when this transformers has no such method."""

    def __enter__(self) -> "_PeerHits":
        self.tokens = 0
        try:
            from transformers.generation.continuous_batching.cache import PagedAttentionCache
        except ImportError:
            self._cls = None
            return self
        self._cls, self._orig = PagedAttentionCache, getattr(PagedAttentionCache, "search_prefix_match", None)
        if self._orig is not None:
            def counted(cache, request_id, prompt_ids, _orig=self._orig):
                n = _orig(cache, request_id, prompt_ids)
                self.tokens += n
                return n
            PagedAttentionCache.search_prefix_match = counted
        return self

    def __exit__(self, *exc) -> None:
        if self._cls is not None and self._orig is not None:
            self._cls.search_prefix_match = self._orig


class Runner:
    def __init__(self, args) -> None:
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="tieredkv-tput-")
        self.cached = Engine.from_pretrained(args.model, cache=CacheConfig(
            device_memory=args.device_memory, host_memory="1GiB", disk_dir=os.path.join(self.tmp, "kv")))
        self.nocache = Engine.from_loaded(self.cached.loaded, cache=CacheConfig(
            device_memory=args.device_memory, host_memory=0, disk_dir=None))
        self.tok = self.cached.tokenizer
        self.block = self.cached.block_size
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        self._plain = None
        self._tenant_no = 0

    def close(self) -> None:
        if self._plain is not None and hasattr(self._plain, "destroy_cached_continuous_batching_manager"):
            self._plain.destroy_cached_continuous_batching_manager()
        self.cached.close()
        self.nocache.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def plain(self):
        # A separate copy with transformers' own attention: generate_batch switches the
        # attention implementation, which must never touch the engines' model.
        if self._plain is None:
            self._plain = load_model(self.args.model).model
        return self._plain

    def _fresh_tenant(self, tag: str) -> str:
        self._tenant_no += 1
        return f"tput-{tag}-{self._tenant_no}"

    # ---- the systems -----------------------------------------------------------------------
    def run_tieredkv(self, w: Workload) -> Run:
        e = self.cached
        for tier in ("device", "host", "disk"):
            e.drop_tier(tier)
        tenant = self._fresh_tenant("cached")
        if w.warm is not None:
            e.generate(w.warm, SamplingParams(max_tokens=1), tenant=tenant)
        with _Clock() as c:
            outs = e.generate(w.prompts, self.params, tenant=tenant)
        _check_lengths([o.token_ids for o in outs], self.args.max_tokens, "tieredkv")
        return Run(c.wall, c.cpu, sum(sum(o.usage.hit_tokens_by_tier.values()) for o in outs),
                   sum(o.usage.prompt_tokens for o in outs))

    def run_nocache(self, w: Workload) -> Run:
        e = self.nocache
        e.drop_tier("device")
        # One tenant per request: namespaces differ, so not even the requests of this batch
        # share a block.
        tenants = [self._fresh_tenant("nocache") for _ in w.prompts]
        with ThreadPoolExecutor(len(w.prompts)) as pool:   # generate() takes one tenant per call
            with _Clock() as c:
                outs = list(pool.map(lambda pt: e.generate(pt[0], self.params, tenant=pt[1]),
                                     zip(w.prompts, tenants)))
        _check_lengths([o.token_ids for o in outs], self.args.max_tokens, "tieredkv_nocache")
        hits = sum(sum(o.usage.hit_tokens_by_tier.values()) for o in outs)
        if hits:
            raise RuntimeError(f"tieredkv_nocache hit {hits} tokens")
        return Run(c.wall, c.cpu, 0, sum(o.usage.prompt_tokens for o in outs))

    @on_limit_thread      # the engine's steps run on a thread of their own too (tools/bench_report.py)
    @torch.inference_mode()
    def run_generate(self, w: Workload) -> Run:
        from transformers import GenerationConfig
        m = self.args.max_tokens
        gc = GenerationConfig(max_new_tokens=m, min_new_tokens=m, do_sample=False,
                              pad_token_id=self.tok.pad_token_id or 0, eos_token_id=None)
        x = torch.tensor(w.prompts)     # equal lengths: one batch, no padding needed
        with _Clock() as c:
            out = self.plain.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
        _check_lengths([row[x.shape[1]:].tolist() for row in out], m, "transformers_generate")
        return Run(c.wall, c.cpu, 0, x.numel())

    def run_batch(self, w: Workload) -> Run:
        from transformers import GenerationConfig
        m = self.args.max_tokens
        gc = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=None,
                              pad_token_id=self.tok.pad_token_id or 0)
        cb = None
        if self.args.peer_page_size or self.args.peer_num_blocks:
            from transformers import ContinuousBatchingConfig
            kw = {"num_blocks": self.args.peer_num_blocks} if self.args.peer_num_blocks else {}
            if self.args.peer_page_size:
                kw["page_size"] = self.args.peer_page_size
            cb = ContinuousBatchingConfig(**kw)
        if w.warm is not None:     # the same untimed warm-up prompt tieredkv is served
            self.plain.generate_batch(inputs=[w.warm], generation_config=GenerationConfig(
                max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=self.tok.pad_token_id or 0),
                continuous_batching_config=cb, persistent_manager=True)
        with _PeerHits() as hits, _Clock() as c:
            # persistent_manager: the manager (its KV cache, its thread) is built once, in the
            # untimed warm-up, as the engines are; a fresh one costs seconds per call on CPU.
            out = self.plain.generate_batch(inputs=w.prompts, generation_config=gc, continuous_batching_config=cb,
                                            persistent_manager=True)
        _check_lengths([o.generated_tokens for o in out.values()], m, "transformers_batch")
        return Run(c.wall, c.cpu, hits.tokens, sum(len(p) for p in w.prompts))

    def warm_up(self, funcs: dict) -> dict[str, str]:
        """First-call costs (allocator, kernels for these shapes, transformers' CB manager) out
        of the timings: one full-length request per system. Returns the systems that failed."""
        failed = {}
        w = Workload(self.tok, 1, self.args.length, 0.0, self.block, salt=0)
        for s in self.args.systems:
            try:
                funcs[s](w)
            except Exception as e:
                if s != "transformers_batch":
                    raise
                failed[s] = f"{type(e).__name__}: {e}"
                print(f"{s} failed: {failed[s]}", file=sys.stderr)
        return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4, help="prompts per run (submitted at once)")
    ap.add_argument("--length", type=int, default=1024, help="prompt length L in tokens")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens M per prompt")
    ap.add_argument("--rates", default=DEFAULT_RATES, help="prefix hit rates for tieredkv")
    ap.add_argument("--baseline-rates", default="0",
                    help="hit rates at which tieredkv_nocache and transformers_generate run ('all' = --rates)")
    ap.add_argument("--peer-rates", default="all",
                    help="hit rates at which transformers_batch runs ('all' = --rates)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    ap.add_argument("--peer-num-blocks", type=int, default=None,
                    help="transformers_batch's KV blocks (default: sized by transformers from free memory, which "
                         "on a CPU is most of the machine's RAM)")
    ap.add_argument("--peer-page-size", type=int, default=None,
                    help="transformers_batch's page size in tokens, its prefix-sharing granularity "
                         "(default: transformers' own, 256; our block size is 16)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per (rate, system) above 0%% hits (median)")
    ap.add_argument("--repeat-zero", type=int, default=2,
                    help="runs per system at 0%% hits, where the targets compare systems (median)")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device-memory", default="1GiB",
                    help="each engine's device pool (a GPU run of 32 x 4096 tokens needs ~3.5 GiB in bf16 to hold them all)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    base_rates = (rates if args.baseline_rates == "all"
                  else [float(r) for r in args.baseline_rates.split(",") if r.strip()])
    peer_rates = (rates if args.peer_rates == "all"
                  else [float(r) for r in args.peer_rates.split(",") if r.strip()])
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        ap.error(f"--systems: expected a subset of {SYSTEMS}")
    if any(not 0 <= r <= 1 for r in rates + base_rates + peer_rates):
        ap.error("--rates: expected numbers in [0, 1]")
    if args.peer_page_size is not None and args.peer_page_size < 4:
        ap.error("--peer-page-size: expected an int >= 4 (transformers' minimum)")
    if args.n < 1 or args.length < 16 or args.max_tokens < 1 or args.repeat < 1 or args.repeat_zero < 1:
        ap.error("--n, --length (>= 16), --max-tokens, --repeat, --repeat-zero: expected positive values")
    logging.basicConfig(level=logging.WARNING)

    runner = Runner(args)
    funcs = {"tieredkv": runner.run_tieredkv, "tieredkv_nocache": runner.run_nocache,
             "transformers_generate": runner.run_generate, "transformers_batch": runner.run_batch}
    rows: list[dict] = []
    try:
        failures = runner.warm_up(funcs)
        runs_at = {"tieredkv": rates, "transformers_batch": peer_rates}
        for ri, rate in enumerate(sorted(set(rates) | set(base_rates) | set(peer_rates))):
            systems = [s for s in args.systems if s not in failures and rate in runs_at.get(s, base_rates)]
            samples: dict[str, list[Run]] = {s: [] for s in systems}
            for rnd in range(args.repeat_zero if rate == 0 else args.repeat):
                # Alternate the order each round: drift in machine load hits all systems alike.
                for s in (systems if rnd % 2 == 0 else systems[::-1]):
                    if s in failures:
                        continue
                    w = Workload(runner.tok, args.n, args.length, rate, runner.block, salt=1 + ri * 101 + rnd)
                    try:
                        run = funcs[s](w)
                    except Exception as e:
                        if s != "transformers_batch":
                            raise
                        # transformers' continuous batching is the one system we do not own:
                        # record why it failed and keep measuring the others.
                        failures[s] = f"{type(e).__name__}: {e}"
                        print(f"{s} failed: {failures[s]}", file=sys.stderr)
                        continue
                    samples[s].append(run)
                    # Progress on stderr; stdout stays one table or one JSON object.
                    print(f"rate {rate:4.0%} {s:<22} {args.n / run.wall_s:7.3f} req/s  (wall {run.wall_s:.2f}s, "
                          f"cpu {run.cpu_s:.1f}s, hit {run.hit_tokens / run.prompt_tokens:.1%})", file=sys.stderr)
            for s in systems:
                runs = samples[s]
                if not runs:
                    continue
                walls, cpus = [r.wall_s for r in runs], [r.cpu_s for r in runs]
                rows.append({"hit_rate": rate, "system": s,
                             "req_per_s": round(args.n / statistics.median(walls), 4),
                             "best_req_per_s": round(args.n / min(walls), 4),
                             "cpu_s_per_req": round(statistics.median(cpus) / args.n, 3),
                             "measured_hit_rate": round(runs[0].hit_tokens / runs[0].prompt_tokens, 4),
                             "wall_s": [round(x, 3) for x in walls], "cpu_s": [round(x, 2) for x in cpus]})
    finally:
        runner.close()

    result = {"rows": rows, "targets": targets(rows, args), "failures": failures,
              "config": {"n": args.n, "length": args.length, "max_tokens": args.max_tokens,
                         "repeat": args.repeat, "repeat_zero": args.repeat_zero, "block_size": runner.block,
                         "peer_page_size": args.peer_page_size or "transformers default (256)",
                         "engine": {"max_batch_tokens": runner.cached.scheduler.max_batch_tokens,
                                    "max_seqs": runner.cached.scheduler.max_seqs}},
              "machine": machine_note()}
    emit(result, args.json, print_table)
    return 0


def _row(rows: list[dict], rate: float, system: str) -> dict | None:
    return next((r for r in rows if r["hit_rate"] == rate and r["system"] == system), None)


def _tput(row: dict, how: str) -> float:
    """Throughput by one estimator: median wall (the definition), best wall, or 1 / CPU s."""
    return {"median": row["req_per_s"], "best": row["best_req_per_s"], "cpu": 1 / row["cpu_s_per_req"]}[how]


ESTIMATORS = ("median", "best", "cpu")


def targets(rows: list[dict], args) -> dict:
    """Each target by three estimators of throughput: the median wall-clock req/s (the
    target's definition), the best run's wall-clock req/s, and requests per CPU-second of
    this process. On a machine shared with other jobs the wall clock moves by tens of percent
    between runs of identical work; the best run and CPU time are far less affected, so a
    verdict that differs between estimators is noise, and says so."""
    def check(name: str, value_of, target: str, ok) -> None:
        values = {how: round(value_of(how), 4) for how in ESTIMATORS}
        met = {how: (ok(v) if ok else None) for how, v in values.items()}
        out[name] = {"value": values["median"], "values": values, "target": target,
                     "met": met["median"], "met_by": met}

    out: dict = {}
    c0, n0, c1 = _row(rows, 0.0, "tieredkv"), _row(rows, 0.0, "tieredkv_nocache"), _row(rows, 1.0, "tieredkv")
    if c0 and n0:
        check("cache_cost_at_0", lambda h: 1 - _tput(c0, h) / _tput(n0, h), "<= 0.02", lambda v: v <= 0.02)
    if c0 and c1:
        check("speedup_100_vs_0", lambda h: _tput(c1, h) / _tput(c0, h), ">= 4.8 (L=1024, M=8)", lambda v: v >= 4.8)
        out["speedup_100_vs_0"]["sizes_as_target"] = args.length == 1024 and args.max_tokens == 8
    b0 = _row(rows, 0.0, "transformers_generate")
    if c0 and b0:
        check("vs_transformers_generate_at_0", lambda h: _tput(c0, h) / _tput(b0, h), "(none)", None)
    for rate in sorted({r["hit_rate"] for r in rows}):
        ours, peer = _row(rows, rate, "tieredkv"), _row(rows, rate, "transformers_batch")
        if ours and peer:
            check(f"vs_transformers_batch_at_{rate:.0%}", lambda h, o=ours, p=peer: _tput(o, h) / _tput(p, h),
                  ">= 1.0", lambda v: v >= 1.0)
    return out


def print_table(result: dict) -> None:
    cfg = result["config"]
    rows = result["rows"]
    print(f"Throughput: N={cfg['n']} prompts x L={cfg['length']} tokens, M={cfg['max_tokens']} output tokens; "
          f"req/s, median of {cfg['repeat_zero']} runs at 0% and {cfg['repeat']} above")
    print(f"{'hit rate':>8}  {'measured':>8}  {'peer hit':>8}" + "".join(f"  {s:>22}" for s in SYSTEMS)
          + "  tieredkv cpu s/req")
    for rate in sorted({r["hit_rate"] for r in rows}):
        meas, peer = _row(rows, rate, "tieredkv"), _row(rows, rate, "transformers_batch")
        cells = "".join(f"  {(format(r['req_per_s'], '.3f') if (r := _row(rows, rate, s)) else '-'):>22}"
                        for s in SYSTEMS)
        cpu = format(meas["cpu_s_per_req"], ".2f") if meas else "-"
        hit = format(meas["measured_hit_rate"], ".1%") if meas else "-"
        peer_hit = format(peer["measured_hit_rate"], ".1%") if peer else "-"
        print(f"{rate:>8.0%}  {hit:>8}  {peer_hit:>8}{cells}  {cpu:>18}")
    print("at 0% hits, every run:")
    for s in SYSTEMS:
        r = _row(rows, 0.0, s)
        if r:
            walls = ", ".join(f"{x:.2f}" for x in r["wall_s"])
            print(f"  {s:<22} wall {walls} s; best {r['best_req_per_s']:.3f} req/s; "
                  f"cpu {r['cpu_s_per_req']:.2f} s/req")
    print("targets, by median wall / best wall / CPU-seconds per request:")
    for name, t in result["targets"].items():
        verdicts = {("-" if m is None else ("met" if m else "MISSED")) for m in t["met_by"].values()}
        verdict = verdicts.pop() if len(verdicts) == 1 else " / ".join(
            "-" if m is None else ("met" if m else "MISSED") for m in t["met_by"].values())
        v = t["values"]
        print(f"  {name:<30} {v['median']:>7} / {v['best']:>7} / {v['cpu']:>7}  target {t['target']:<22} {verdict}")
    for s, why in result["failures"].items():
        print(f"  {s} failed: {why}")
    print(f"machine: {result['machine']}")


if __name__ == "__main__":
    sys.exit(main())
