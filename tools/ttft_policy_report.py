"""bench_ttft --restore-policy's rows, the issue's targets judged on them, and its table.

Knows: medians of the samples tools/ttft_policies.py took, and the targets of issue 27 (item 4,
after issue 18's), ratios of medians of one run:
    hit    auto / miss <= 1.1x for every hit, the first after a restart included
           (a stalled store: <= 1.2x)                          the cache never makes a request slower
    (a)    auto <= 1.05x min(load, recompute), judged where auto's decision (load, recompute,
           split; per sample) differs from the faster forced one: the planner is never the
           slower way (where it chose as the faster one did, it is that one)
    (b)    where load and recompute are within 1.5x of each other at >= 1024 tokens,
           auto <= 0.75x their minimum (both having hit the    computing the front while the back
           whole prefix from the source)                       loads beats either alone
(b) carries whether it can be met at all: a split computes its front in a step of its own and the
suffix in the step after both parts, so no split is faster than the device hit (the suffix step)
+ one step's fixed cost (the engine's fitted prefill overhead); where that floor is above 0.75x
the faster way, the row says "(floor ...)". First rows (a new engine's first request, under auto)
are judged on "hit" only. Doesn't know: how the samples were taken.
"""
from __future__ import annotations

import statistics

HIT_TARGET = 1.1
STALL_HIT_TARGET = 1.2
PICK_TARGET = 1.05          # (a)
CLOSE = 1.5                 # (b) applies where max(load, recompute) <= CLOSE x min(load, recompute)
SPLIT_TARGET = 0.75         # (b)
SPLIT_MIN_TOKENS = 1024     # (b) from this prefix length up
COLUMNS = ("miss", "device", "load", "recompute", "auto")


def _decision(recomputed: int, hit: int) -> str:
    if hit == 0:
        return "miss"          # nothing hit (a stalled store's probe timed out): nothing to decide
    return "load" if recomputed == 0 else "recompute" if recomputed >= hit else "split"


def _row(bench, kind: str, n: int) -> dict | None:
    src = bench.source
    cols = {c: bench.samples[(kind, n, c)] for c in COLUMNS if (kind, n, c) in bench.samples}
    if not cols:
        return None
    med = {c: statistics.median(s[0] for s in v) for c, v in cols.items()}
    row = {"source": src.label, "tier": src.tier, "kind": kind, "prefix_tokens": n,
           "ttft_s": {c: round(v, 5) for c, v in med.items()},
           "samples_s": {c: [round(s[0], 5) for s in v] for c, v in cols.items()},
           "queue_s": {c: [round(q, 5) for q in getattr(bench, "queues", {}).get((kind, n, c), [])] for c in cols},
           "recomputed_hit_tokens": {c: statistics.median(s[1] for s in v) for c, v in cols.items()
                                     if c not in ("miss", "device")},
           "hit_tokens": {c: [s[2] for s in v] for c, v in cols.items() if c not in ("miss", "device")},
           "guard_fired": sum(s[3] for v in cols.values() for s in v)}
    auto = cols.get("auto")
    targets: dict[str, dict | None] = {"hit": None, "pick": None, "split": None}
    if auto is not None:
        # The chosen split per request: hit tokens recomputed from the front, the rest loaded.
        row["auto_split"] = [{"recomputed_tokens": r, "loaded_tokens": h - r} for _, r, h, _ in auto]
        if "miss" in med:
            target = STALL_HIT_TARGET if src.label == "stalled" else HIT_TARGET
            ratio = med["auto"] / med["miss"]
            targets["hit"] = {"ratio": round(ratio, 3), "target": target, "met": ratio <= target}
    if auto is not None and "load" in med and "recompute" in med:
        best = min(med["load"], med["recompute"])
        faster = "load" if med["load"] <= med["recompute"] else "recompute"
        ratio = med["auto"] / best
        decisions = sorted({_decision(r, h) for _, r, h, _ in auto})
        judged = decisions != [faster]
        targets["pick"] = {"ratio": round(ratio, 3), "target": PICK_TARGET, "faster": faster,
                           "auto_decisions": decisions, "judged": judged,
                           "met": ratio <= PICK_TARGET if judged else None}
        close = max(med["load"], med["recompute"]) <= CLOSE * best
        # Only a real choice: both forced ways got the whole prefix from the source (a stalled
        # store's timed-out probe leaves nothing to split).
        whole = all(h == n for c in ("load", "recompute") for _, _, h, _ in cols[c])
        judged = close and whole and n >= SPLIT_MIN_TOKENS
        floor = med.get("device", 0.0) + getattr(bench, "overhead_s", 0.0)
        targets["split"] = {"ratio": round(ratio, 3), "target": SPLIT_TARGET, "close": close, "judged": judged,
                            "met": ratio <= SPLIT_TARGET if judged else None,
                            "floor_s": round(floor, 5), "floor_vs_best": round(floor / best, 3),
                            "feasible": floor / best <= SPLIT_TARGET}
    row["targets"] = targets
    return row


def report_rows(benches: list, lengths: list[int]) -> list[dict]:
    """Per source: its steady rows, then its first rows, by prefix length."""
    rows, by_source = [], {}
    for b in benches:
        by_source.setdefault(b.source.label, []).append(b)
    for group in by_source.values():
        for kind in ("steady", "first"):
            for n in lengths:
                for b in group:
                    row = _row(b, kind, n)
                    if row is not None:
                        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per target: rows judged, rows met, and whether all met (None: no row judged)."""
    out = {}
    for name in ("hit", "pick", "split"):
        judged = [r["targets"][name] for r in rows if r["targets"][name] and r["targets"][name].get("judged", True)]
        met = sum(1 for t in judged if t["met"])
        out[name] = {"judged": len(judged), "met": met, "all_met": met == len(judged) if judged else None}
    feasible = [r["targets"]["split"] for r in rows if r["targets"]["split"] and r["targets"]["split"]["judged"]
                and r["targets"]["split"]["feasible"]]
    out["split"]["all_met_where_feasible"] = all(t["met"] for t in feasible) if feasible else None
    return out


def _ms(row: dict, col: str) -> str:
    v = row["ttft_s"].get(col)
    return "-" if v is None else f"{v * 1e3:.1f}"


def _cell(t: dict | None, floor: bool = False) -> str:
    if t is None:
        return "-"
    if not t.get("judged", True):
        return f"{t['ratio']:.2f}x -"
    text = f"{t['ratio']:.2f}x {'met' if t['met'] else 'MISSED'}"
    if floor and not t["met"] and not t["feasible"]:
        text += f" (floor {t['floor_vs_best']:.2f}x)"    # no split can meet it: the suffix alone takes more
    return text


def _verdict(s: dict, key: str = "all_met") -> str:
    v = s[key]
    return "no such case" if v is None else f"{'met' if v else 'MISSED'} ({s['met']}/{s['judged']})"


def print_table(report: dict) -> None:
    from bench_prompts import SUFFIX_TOKENS
    print(f"TTFT of a hit below the device by restore policy, prefix + {SUFFIX_TOKENS}-token suffix, max_tokens=1, "
          f"medians of {report['repeat']} (first: one request each), ms; codec {report['codec']}, "
          f"remote timeout {report['remote_timeout_s']:g} s")
    head = (f"{'source':<15} {'kind':<6} {'prefix':>6} {'miss':>8} {'device':>7} {'load':>8} {'recomp':>8} {'auto':>8} "
            f"{'auto split r/l':>16}  {'auto/miss':<14} {'(a) auto/min':<14} {'(b) auto/min':<26}")
    print(head)
    for r in report["rows"]:
        splits = sorted({(s["recomputed_tokens"], s["loaded_tokens"]) for s in r.get("auto_split", [])})
        text = ", ".join(f"{a}/{b}" for a, b in splits)
        partial = any(h != r["prefix_tokens"] for v in r["hit_tokens"].values() for h in v)
        mark = ("*" if partial else "") + ("!" if r["guard_fired"] else "")
        t = r["targets"]
        hit = _cell(t["hit"])
        if t["hit"] is not None:
            hit = hit.replace("x ", f"x<={t['hit']['target']:g} ", 1)
        print(f"{r['source']:<15} {r['kind']:<6} {r['prefix_tokens']:>6} {_ms(r, 'miss'):>8} {_ms(r, 'device'):>7} "
              f"{_ms(r, 'load'):>8} {_ms(r, 'recompute'):>8} {_ms(r, 'auto'):>8} {text[:15] + mark:>16}  "
              f"{hit:<14} {_cell(t['pick']):<14} {_cell(t['split'], floor=True):<26}")
    s = report["summary"]
    print(f"targets: every hit auto <= {HIT_TARGET}x its miss (stalled store <= {STALL_HIT_TARGET}x): "
          f"{_verdict(s['hit'])}; (a) auto <= {PICK_TARGET}x min(load, recompute) where auto decided otherwise "
          f"than the faster: {_verdict(s['pick'])}; (b) where the two are within {CLOSE}x at >= {SPLIT_MIN_TOKENS} "
          f"tokens, auto <= {SPLIT_TARGET}x their minimum: {_verdict(s['split'])}, where a split's floor allows it: "
          f"{'no such case' if s['split']['all_met_where_feasible'] is None else 'met' if s['split']['all_met_where_feasible'] else 'MISSED'}")
    print("rows: steady = medians on an engine that has served this source before; first = a new engine's first "
          "request (same disk dir and store, nothing learned), under auto, beside a cold miss on that engine. "
          "'x -': not judged (auto decided as the faster forced one did; (b): not within 1.5x, or < 1024 tokens)")
    print("floor: a split's least TTFT (the device hit's, i.e. the suffix step, + one step's fitted fixed cost for "
          f"the front) over min(load, recompute); above {SPLIT_TARGET}x, (b) cannot be met by any split")
    print("auto split r/l: hit tokens recomputed / loaded per request; * some hit came partly or not at all from "
          f"the source (a stalled or timed-out store, or a load past its deadline, computed); ! the stall guard ({report['stall_guard_s']:g} s) resumed "
          f"the store ({report['stall_guard_fired']} times in all)")
    for label, cm in report["cost_model"].items():
        print(f"cost model ({label}, after its rounds): restore B/s {cm['restore_bytes_per_s']}, "
              f"prefill {cm['prefill']}, planner {cm['planner']}")
    for label, by_n in report["first_cost_model"].items():
        n, cm = min(by_n.items())
        print(f"cost model ({label}, a new engine before its first hit at {n}): restore B/s "
              f"{cm['restore_bytes_per_s']}, prefill {cm['prefill']}")
    print(f"machine: {report['machine']}")
