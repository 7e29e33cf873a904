"""Issue 39's figures, each beside its peer measured in the same run: a retained prompt survives a
flood of distinct unretained prompts whose working set is 5x the whole cache (device + host + disk),
and what retention's bookkeeping adds to a device hit.

    row                      what is measured                                  beside (same run)
    retained hit rate        R prompts sent with retain=[RetainSpan(None,      target 1.0
                             "24h" or "1h")] among the flood's first fifth,
                             each sent again after the whole flood: hit tokens
                             / tokens of the prompt's full blocks
    unretained hit rate      a sample of the flood's prompts (evenly spread     what LRU gives (no target)
                             over it, newest first) sent again, the same ratio
    retained re-request      median TTFT of those re-requests (after the        a plain recompute: median TTFT
    unretained re-request    sample's); median TTFT of the sample's            of cold prompts of the same length
    hit, same prompt         a device hit of one prompt repeated (an exact      the same hit without retain,
      + retain               hit: nothing computed) sent with retain (each     paired, alternating, a pause
                             a refresh of its retention)                       between; <= 1.05x (the pairs'
                                                                               median ratio)
    hit, new suffix          its full blocks + a new 16-token suffix each       likewise
      + retain               time, the full blocks retained (a breakpoint)
    retain() call            TieredKVCache.retain of that prompt's chain       the same-prompt hit's TTFT; <= 5%
                             (the cache's bookkeeping at submit), median
                             of many calls on this thread

The cache is small on purpose (--device-pages, --host-slots, --disk-blocks, in blocks of the model's
raw KV): the flood's size is fixed after a warm-up request measured the disk's bytes per block (the
codec's ratio), so that its blocks -- every prompt's full blocks and its exact entry -- are
--flood-x times the blocks the cache holds; the blocks the cache held when the flood ended are
counted, the flood goes on if it is short, and the measured multiple is reported. Retention's
bound: the retained prompts' blocks and one prompt's more (the bookkeeping rows'); every prompt
is one tenant's, max_tokens=1. The retained prompts are all in the flood's first fifth,
so LRU alone would have dropped them (at least 4x the cache of flood comes after the last).
The engine's close logs that its final flush is incomplete: the disk is that small on purpose.

The model by default: SmolLM2-135M's real shape with random weights (tools/model_shapes/smollm2-135m:
timings are the real model's, texts are not); --model default: the real SmolLM2-135M-Instruct;
--quick: the tiny Llama shape, fewer prompts (a smoke run, under a minute).

    python tools/bench_retention.py [--quick] [--model PATH|default] [--json]
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_prompts import SUFFIX_TOKENS, prose_ids  # noqa: E402  (sibling scripts)
from bench_report import emit, machine_note  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.model import kv_layout, load_model  # noqa: E402
from engine.paged_attention import ATTN_NAME, register  # noqa: E402
from engine.retain_spans import RetainSpan  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_shapes")
DEFAULT_MODEL = os.path.join(SHAPES, "smollm2-135m")
QUICK_MODEL = os.path.join(SHAPES, "tiny-llama")
TENANT = "bench"
CLASSES = ("24h", "1h")            # the retained prompts alternate between them
OVERHEAD_TARGET = 0.05             # retention's bookkeeping on a device hit: <= 5% of its TTFT
TAIL_TOKENS = 5                    # a prompt's tokens past its full blocks (computed, never a block)
ONE = SamplingParams(max_tokens=1)
PAUSE_S = 0.02                     # between paired requests: the writers finish the one before


@dataclass(frozen=True)
class Plan:
    prompt_blocks: int = 6         # full blocks per prompt
    retained: int = 4
    sample: int = 8                # unretained prompts sent again
    recompute: int = 4             # cold prompts: the plain recompute
    device_pages: int = 12
    host_slots: int = 12
    disk_blocks: int = 52          # the disk's capacity in raw blocks (it holds more: the codec's ratio)
    flood_x: float = 5.0
    pairs: int = 15                # device hit with / without retain
    retain_calls: int = 300


QUICK = Plan(prompt_blocks=8, retained=2, sample=3, recompute=2, device_pages=10, host_slots=4, disk_blocks=32,
             pairs=3, retain_calls=50)


def prompt(eng: Engine, head: str, i: int, n: int) -> list[int]:
    """`n` tokens: a head naming the prompt (so no two share a first block) and prose from an offset."""
    ids = eng.encode(f"{head} {i:05d}.")
    return (ids + prose_ids(eng.tokenizer, n, offset=(i * 53) % 700))[:n]


def ask(eng: Engine, ids: list[int], retain: tuple[RetainSpan, ...] = ()) -> tuple[float, object]:
    out = eng.generate(ids, ONE, tenant=TENANT, retain=retain)
    return out.metrics.ttft_s, out.usage


def hit_rate(usages: list, full_tokens: int) -> tuple[float, dict[str, int]]:
    """Hit tokens (each request's capped at its full blocks) / full-block tokens, and hits by tier."""
    tiers: dict[str, int] = {}
    for u in usages:
        for t, n in u.hit_tokens_by_tier.items():
            tiers[t] = tiers.get(t, 0) + n
    hit = sum(min(u.prompt_cache_hit_tokens, full_tokens) for u in usages)
    return hit / (full_tokens * len(usages)), {t: n for t, n in tiers.items() if n}


def build(model: str | None, root: str, plan: Plan) -> Engine:
    register()
    loaded = load_model(model, attn_implementation=ATTN_NAME, cache_dir=root)
    block = kv_layout(loaded, 16).nbytes
    # Retention's bound: the retained prompts' blocks and one more prompt's (bookkeeping's), no more.
    bound = (plan.retained + 1) * plan.prompt_blocks * block
    if bound >= plan.disk_blocks * block:
        raise SystemExit(f"--disk-blocks {plan.disk_blocks}: retention needs {bound // block} blocks below the "
                         f"disk's capacity ((--retained + 1) x --prompt-blocks)")
    cfg = CacheConfig(block_size=16, device_memory=plan.device_pages * block, host_memory=plan.host_slots * block,
                      disk_dir=os.path.join(root, "kv"), disk_capacity=plan.disk_blocks * block, disk_reserve=0,
                      max_retained=bound)
    return Engine.from_loaded(loaded, cfg)


def held_blocks(eng: Engine) -> dict[str, int]:
    eng.cache.disk.drain(timeout=120)
    st = eng.cache.stats()
    return {t: st[t].blocks for t in ("device", "host", "disk")}


def flood_run(eng: Engine, plan: Plan, n_tokens: int, log) -> dict:
    full = plan.prompt_blocks * eng.block_size
    # Warm-up (another tenant): first-call costs, and the disk's bytes per block once flushed.
    warm = prompt(eng, "Warm-up", 0, n_tokens)
    eng.generate(warm, ONE, tenant="warm")
    eng.cache.flush(timeout=120)
    ratio = max(1.0, eng.cache.disk.stats().compression_ratio)
    disk_est = int(plan.disk_blocks * ratio)
    cache_est = plan.device_pages + plan.host_slots + disk_est
    ex = eng.exact_keys(warm, eng.namespace(TENANT))
    per_prompt = len(ex.chain) if ex is not None else plan.prompt_blocks
    flood = math.ceil(plan.flood_x * cache_est / per_prompt)
    at = {round((k + 0.5) * flood / (5 * plan.retained)): k for k in range(plan.retained)}
    retained = [prompt(eng, "Retained", k, n_tokens) for k in range(plan.retained)]
    flooded = []
    log(f"flood: {flood} prompts x {per_prompt} blocks into a cache of ~{cache_est} blocks "
        f"(disk codec ratio {ratio:.2f}); {plan.retained} retained in its first fifth")
    first: list = []
    t0 = time.perf_counter()
    while True:
        for i in range(len(flooded), flood):
            if i in at:
                k = at[i]
                _, u = ask(eng, retained[k], (RetainSpan(None, CLASSES[k % 2]),))
                first.append(u)
            ids = prompt(eng, "Ticket", i, n_tokens)
            flooded.append(ids)
            ask(eng, ids)
            if (i + 1) % 20 == 0:
                log(f"  {i + 1}/{flood} ({time.perf_counter() - t0:.0f} s)")
        held = held_blocks(eng)
        # The estimate was short if the cache holds more than it said: the flood goes on until
        # it is --flood-x times the blocks the cache holds.
        need = math.ceil(plan.flood_x * sum(held.values()) / per_prompt)
        if flood >= need:
            break
        log(f"  the cache holds {sum(held.values())} blocks: the flood goes on to {need} prompts")
        flood = need
    # Again: the sample of the flood (evenly spread over it, newest first: what LRU holds is asked
    # before the misses push it out), then every retained prompt, under the sample's misses too.
    picks = sorted({round(j * (flood - 1) / max(1, plan.sample - 1)) for j in range(plan.sample)}, reverse=True)
    u_ttft, u_use = zip(*(ask(eng, flooded[j]) for j in picks))
    r_ttft, r_use = zip(*(ask(eng, ids) for ids in retained))
    cold = [ask(eng, prompt(eng, "Cold", j, n_tokens))[0] for j in range(plan.recompute)]
    r_rate, r_tiers = hit_rate(list(r_use), full)
    u_rate, u_tiers = hit_rate(list(u_use), full)
    last = max(at)
    return {
        "flood_prompts": flood, "blocks_per_prompt": per_prompt, "working_set_blocks": flood * per_prompt,
        "cache_blocks_estimate": cache_est, "disk_codec_ratio": round(ratio, 3),
        "cache_blocks_held_after_flood": held,
        "working_set_x_cache": round(flood * per_prompt / sum(held.values()), 2),
        "flood_after_last_retained_x_cache": round((flood - last) * per_prompt / sum(held.values()), 2),
        "retained_classes": [CLASSES[k % 2] for k in range(plan.retained)],
        "retained_first_writes": [u.cache_write_tokens for u in first],
        "refused_tokens": sum(u.retention_refused_tokens for u in first),
        "hit_rate": {"retained": round(r_rate, 4), "retained_target": 1.0, "unretained": round(u_rate, 4),
                     "retained_by_tier": r_tiers, "unretained_by_tier": u_tiers,
                     "unretained_sample": picks},
        "ttft_s": {"retained": statistics.median(r_ttft), "unretained": statistics.median(u_ttft),
                   "recompute": statistics.median(cold)},
        "retention": {k: v for k, v in eng.cache.retention_status().items() if k != "tenants"},
    }


def paired(eng: Engine, plan: Plan, make, span: tuple[RetainSpan, ...], expect_device: int) -> dict:
    """`make(i)`'s prompt sent with `span` and without, in pairs (alternating which goes first),
    each after a pause that lets the writers finish the request before (so each request carries
    its own cost); medians, bests, and the overhead of the pairs."""
    with_, without = [], []
    for p in range(plan.pairs):
        for on in ((True, False) if p % 2 == 0 else (False, True)):
            time.sleep(PAUSE_S)
            s, u = ask(eng, make(2 * p + on), span if on else ())
            # Every cached token from the device, none refused.
            assert u.hit_tokens_by_tier["device"] == u.prompt_cache_hit_tokens >= expect_device, u
            assert not u.retention_refused_tokens, u
            (with_ if on else without).append(s)
    med_w, med_o = statistics.median(with_), statistics.median(without)
    # The overhead: the median of the pairs' ratios (a pair's two requests see the same load, so
    # this machine's drift cancels), and the ratio of the bests.
    pair = statistics.median(w / o for w, o in zip(with_, without))
    return {"with_retain_s": med_w, "without_s": med_o,
            "best_with_retain_s": min(with_), "best_without_s": min(without),
            "overhead": round(pair - 1, 4), "overhead_best": round(min(with_) / min(without) - 1, 4)}


def bookkeeping(eng: Engine, plan: Plan, n_tokens: int) -> dict:
    """A device hit with and without retain, paired -- the same prompt repeated (an exact hit where
    the engine keeps one: nothing computed, the smallest TTFT there is), and the same full blocks
    with a new 16-token suffix each time, only they retained (a system prompt under a breakpoint) --
    and TieredKVCache.retain of the prompt's chain alone (a refresh: what a hit asks)."""
    ids = prompt(eng, "Hot", 0, n_tokens)
    full = plan.prompt_blocks * eng.block_size
    whole = (RetainSpan(None, "24h"),)
    ask(eng, ids, whole)
    ask(eng, ids)
    repeat = paired(eng, plan, lambda i: ids, whole, full)
    prefix = ids[:full]
    suffixed = paired(eng, plan, lambda i: prefix + prose_ids(eng.tokenizer, SUFFIX_TOKENS, offset=100 + 17 * i),
                      (RetainSpan(full, "24h"),), full)
    keys = eng.prompt_keys(ids, TENANT)[1]
    calls = []
    for _ in range(plan.retain_calls):
        t0 = time.perf_counter()
        eng.cache.retain(TENANT, keys, "24h")
        calls.append(time.perf_counter() - t0)
    call = statistics.median(calls)
    return {"prompt_tokens": len(ids), "chain_blocks": len(keys), "pairs": plan.pairs,
            "exact_hit": eng.exact_keys(ids, eng.namespace(TENANT)) is not None,
            "repeat": repeat, "new_suffix": {"suffix_tokens": SUFFIX_TOKENS, **suffixed},
            "retain_call_us": round(call * 1e6, 1), "retain_call_best_us": round(min(calls) * 1e6, 1),
            "retain_call_vs_device_hit": round(call / repeat["without_s"], 4), "target": OVERHEAD_TARGET}


def rows(res: dict) -> list[dict]:
    f, b = res["flood"], res["bookkeeping"]
    rec = f["ttft_s"]["recompute"]
    rep, suf = b["repeat"], b["new_suffix"]
    return [
        {"row": "retained hit rate", "measured": f["hit_rate"]["retained"], "beside": 1.0, "unit": "",
         "ok": f["hit_rate"]["retained"] >= 1.0},
        {"row": "unretained hit rate (LRU)", "measured": f["hit_rate"]["unretained"], "beside": None, "unit": "",
         "ok": None},
        {"row": "retained re-request TTFT", "measured": f["ttft_s"]["retained"], "beside": rec, "unit": "s",
         "ratio": round(f["ttft_s"]["retained"] / rec, 3), "ok": None},
        {"row": "unretained re-request TTFT", "measured": f["ttft_s"]["unretained"], "beside": rec, "unit": "s",
         "ratio": round(f["ttft_s"]["unretained"] / rec, 3), "ok": None},
        {"row": "hit, same prompt + retain", "measured": rep["with_retain_s"], "beside": rep["without_s"],
         "unit": "s", "ratio": round(1 + rep["overhead"], 3), "ratio_best": round(1 + rep["overhead_best"], 3),
         "ok": rep["overhead"] <= OVERHEAD_TARGET},
        {"row": "hit, new suffix + retain", "measured": suf["with_retain_s"], "beside": suf["without_s"],
         "unit": "s", "ratio": round(1 + suf["overhead"], 3), "ratio_best": round(1 + suf["overhead_best"], 3),
         "ok": suf["overhead"] <= OVERHEAD_TARGET},
        {"row": "retain() call", "measured": b["retain_call_us"] * 1e-6, "beside": rep["without_s"], "unit": "s",
         "ratio": b["retain_call_vs_device_hit"], "ok": b["retain_call_vs_device_hit"] <= OVERHEAD_TARGET},
    ]


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e6:.0f} us" if v < 1e-3 else f"{v * 1e3:.1f} ms"
    return f"{v:.3f}"


def print_table(res: dict) -> None:
    f, c = res["flood"], res["config"]
    print(f"Retention under a flood: {c['model']}, {c['prompt_tokens']}-token prompts "
          f"({c['prompt_blocks']} full blocks), "
          f"{f['flood_prompts']} distinct unretained prompts = {f['working_set_x_cache']}x the blocks the cache held "
          f"({f['cache_blocks_held_after_flood']}); {c['retained']} retained "
          f"({'/'.join(sorted(set(f['retained_classes'])))})")
    print(f"{'row':28} {'measured':>10} {'beside':>10} {'ratio':>7} {'best':>6}  ok")
    for r in res["rows"]:
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        best = f"{r['ratio_best']:.3f}" if "ratio_best" in r else "-"
        print(f"{r['row']:28} {_fmt(r['measured'], r['unit']):>10} {_fmt(r['beside'], r['unit']):>10} {ratio:>7} "
              f"{best:>6}  {ok}")
    b = res["bookkeeping"]
    rep, suf = b["repeat"], b["new_suffix"]
    print(f"beside: re-requests against a cold recompute of the same length; each device hit with retain against "
          f"the same hit without ({b['pairs']} pairs, medians; bests {rep['best_with_retain_s'] * 1e3:.2f} vs "
          f"{rep['best_without_s'] * 1e3:.2f} ms and {suf['best_with_retain_s'] * 1e3:.1f} vs "
          f"{suf['best_without_s'] * 1e3:.1f} ms; the same prompt "
          f"{'an exact hit' if b['exact_hit'] else 'its tail computed'});"
          f" retain() of a {b['chain_blocks']}-block chain against the same-prompt hit. Hits by tier: retained "
          f"{f['hit_rate']['retained_by_tier']}, unretained {f['hit_rate']['unretained_by_tier']}")
    print(f"machine: {res['machine']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or shape directory; 'default': the real "
                    "SmolLM2-135M-Instruct (default: its shape, random weights)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny Llama shape, fewer prompts")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    for name, v in asdict(Plan()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(v), default=None, help=f"default {v}")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else Plan()
    plan = Plan(**{k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in asdict(base).items()})
    if plan.retained < 1 or plan.sample < 1 or plan.recompute < 1 or plan.pairs < 1 or plan.prompt_blocks < 1:
        ap.error("--retained, --sample, --recompute, --pairs, --prompt-blocks: expected >= 1")
    model = None if args.model == "default" else (args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL))
    logging.basicConfig(level=logging.WARNING)

    def log(msg: str) -> None:       # progress on stderr; stdout stays one table or one JSON object
        print(msg, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-retention-") as root:
        with build(model, root, plan) as eng:
            n_tokens = plan.prompt_blocks * eng.block_size + TAIL_TOKENS
            flood = flood_run(eng, plan, n_tokens, log)
            books = bookkeeping(eng, plan, n_tokens)
            config = {"model": eng.model_name, "dtype": str(eng.layout.dtype).removeprefix("torch."),
                      "block_size": eng.block_size, "block_bytes": eng.layout.nbytes, "prompt_tokens": n_tokens,
                      **asdict(plan)}
    res = {"config": config, "flood": flood, "bookkeeping": books, "machine": machine_note()}
    res["rows"] = rows(res)
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
