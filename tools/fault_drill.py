"""Fault drill: attack the disk tier and the engine as an adversary and a careless operator would,
and count what matters: wrong bytes served (must be 0), hangs and crashes (must be 0), stores
that cannot be reopened, acknowledged blocks lost after kill -9 (must be 0), and requests failed
that did not cause the fault (must be 0).

    python tools/fault_drill.py --quick          # ~60 page flips, 1-2 minutes (each hang costs its timeout)
    python tools/fault_drill.py                  # 520 page flips, the full drill
    python tools/fault_drill.py --json --flips 180 --keep-failed /tmp/kept
    python tools/fault_drill.py --only page_flip --kinds lru_leaf,freedb_leaf --flips 60
    python tools/fault_drill.py --self-check     # the page classifier against LMDB's own counts

The attacked store: capacity 1 MiB, ~3 MiB of blocks put (first at twice the capacity, then at
1 MiB, with reads between batches), so eviction has run and the `lru` and free-page databases
hold something: tools/lmdb_pages.py labels each page of its data.mdb.

Attacks (each on real LMDB files and real processes):
  page_flip    one bit flipped in one page of each kind (tools/lmdb_pages.py: the meta pages, the
               free-page database's branch/leaf pages, free-listed pages, the main database's leaf,
               each named database's branch/leaf pages, overflow head and continuation pages),
               --flips trials spread evenly over the kinds the store has. Part of the flips
               (--header-bias) aim at header fields: pgno, flags, lower/upper, the node-offset
               array, a node's header, an overflow run's page count; the rest at the page's used
               bytes. Then a trial runs in two child processes, each killed (and counted as a
               hang, with every thread's stack) when it outlives --hang-timeout:
                 run     open a writable DiskTier, verify(), read every stored block (right,
                         wrong, missed), put ~1.2 MiB of new blocks (evictions), drain(timeout),
                         read them back, close();
                 reopen  open a writable DiskTier again (a restart), check(), read every block,
                         close().
  truncate     data.mdb cut at a random length: the same trial.
  swap         payloads rotated among keys (what a damaged page pointer does): the same trial.
  kill9        a writer process killed with SIGKILL at a random moment, again and again; after each,
               the store must open, pass check() and verify(), and hold every block the writer had
               acknowledged (drain() returned) before it died.
  full_disk    writes into a small tmpfs until it is full: no crash, drain() False, the store
               opens afterwards (skipped, and said so, where tmpfs cannot be mounted).
  read_errors  an engine serving concurrent requests while every disk read fails: every request
               completes with the same greedy tokens as without the fault.

Outcomes counted per trial (page kind, truncate, swap):
  hang            a child killed at --hang-timeout (its stacks are kept: failures[].where)
  crash           a child that died of a signal or exited without finishing (not a caught error)
  open_failed     the run's DiskTier(...) raised (neither opened nor moved aside)
  cannot_reopen   the reopen's DiskTier(...) raised, crashed or hung
  moved_aside     the tier found the store damaged at open and moved it aside (recovered)
  wrong_bytes_served  blocks returned whose bytes differ from what was stored (must be 0)
  verify_said_clean_but_failed  verify() found 0 damaged blocks, then the run met an LMDB error
                  (MDB_CORRUPTED, ...), write errors, a hang or a crash
  write_errors    trials whose writer dropped blocks (stats().write_errors > 0; blocks in
                  write_errors_blocks); flush_false: drain(timeout) returned False
  lmdb_errors     trials where an LMDB error was raised or logged anywhere
  audit_failed    the reopen's check() found problems
  no_effect       nothing at all happened: every block served intact, no error, check() clean
The JSON keeps, per kind, the first distinct failures (exception text and the repo frames it was
raised from, or a hung thread's stack) with how often each was seen.
Prints a table, and with --json one JSON object.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from drill_attacks import attack_full_disk, attack_kill9, attack_read_errors  # noqa: E402
from drill_damage import flip_at, plan_flips, swap_payloads, truncate  # noqa: E402
from drill_store import FRESH_BYTES, SMALL_CAP, populate_evicting  # noqa: E402
from drill_tally import _COUNTS, Tally, outcome  # noqa: E402
from drill_trial import run_child  # noqa: E402


def self_check(blocks: int = 600, capacity: int = SMALL_CAP) -> int:
    """Populate a store the drill's way and check tools/lmdb_pages.py's walk against LMDB's own
    counts (page kinds per database, every page in a tree or free-listed)."""
    from lmdb_pages import classify, compare_with_lmdb, print_counts
    with tempfile.TemporaryDirectory() as tmp:
        populate_evicting(os.path.join(tmp, "kv"), blocks, capacity)
        pm = classify(os.path.join(tmp, "kv"))
        diffs = compare_with_lmdb(os.path.join(tmp, "kv"), pm)
        print_counts(pm)
    print("self-check:", "OK, the walk agrees with LMDB's page counts" if not diffs else "MISMATCH")
    for d in diffs:
        print("  ", d)
    return 1 if diffs else 0


def run_trials(base: Path, known: list[int], fresh: list[int], plans: list[dict], args, ctx, rng_seed: int
               ) -> dict[str, Tally]:
    """Run every planned trial (workers at a time); a Tally per plan group."""
    tallies: dict[str, Tally] = {}
    lock = threading.Lock()
    done = [0]
    root = Path(tempfile.mkdtemp(prefix="drill-trials-"))
    log_every = max(1, len(plans) // 20)

    def one(n: int, plan: dict) -> None:
        work = root / f"t{n}"
        work.mkdir()
        try:
            store = work / "kv"
            shutil.copytree(base, store)
            if plan["damage"] == "flip":
                flip_at(store, plan["at"], plan["bit"])
            elif plan["damage"] == "truncate":
                truncate(store, random.Random(rng_seed * 1000003 + n))
            else:
                swap_payloads(store, random.Random(rng_seed * 1000003 + n))
            if args.keep_failed:
                shutil.copytree(store, work / "damaged")
            run = run_child(ctx, "phase_run", (str(store), known, fresh, SMALL_CAP, args.flush_timeout), work,
                            args.hang_timeout)
            reopen = run_child(ctx, "phase_reopen", (str(store), known + fresh, SMALL_CAP, args.flush_timeout), work,
                               args.hang_timeout)
            o = outcome(run, reopen, len(known))
            if args.keep_failed and (o["hang"] or o["crash"] or o["cannot_reopen"] or o["open_failed"]
                                     or o["wrong_bytes_served"]):
                keep = Path(args.keep_failed) / f"{n:04d}-{plan['group']}-{plan.get('field', '')}"
                shutil.copytree(work / "damaged", keep / "kv", dirs_exist_ok=True)
                (keep / "trial.json").write_text(json.dumps({**plan, "outcome": o, "run": run, "reopen": reopen},
                                                            indent=1))
            with lock:
                tallies.setdefault(plan["group"], Tally()).add(o, run, reopen, plan.get("field"))
                if args.trials_jsonl:
                    with open(args.trials_jsonl, "a") as f:
                        f.write(json.dumps({**plan, "outcome": o, "run": run, "reopen": reopen}) + "\n")
                done[0] += 1
                if not args.json and done[0] % log_every == 0:
                    print(f"  ... {done[0]}/{len(plans)} trials", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    try:
        with ThreadPoolExecutor(args.workers) as pool:
            for f in [pool.submit(one, n, p) for n, p in enumerate(plans)]:
                f.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tallies


def _forkserver():
    """A forkserver that imported this module (torch, lmdb, the tier): each trial's children fork
    from it, so a child costs its work, not an interpreter start and a torch import. (Python 3.11's
    forkserver ignores the parent's sys.path: the module is found through PYTHONPATH.)"""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tools"),
                                                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "fault_drill"])   # __main__: no re-run of the script per child
    return ctx


_QUICK = {"flips": 60, "truncations": 4, "swaps": 2, "kills": 2, "requests": 4}
_FULL = {"flips": 520, "truncations": 10, "swaps": 5, "kills": 8, "requests": 8}
_COLUMNS = [("trials", "trials"), ("hang", "hang"), ("crash", "crash"), ("open_failed", "openfail"),
            ("cannot_reopen", "noreopen"), ("moved_aside", "aside"), ("wrong_bytes_served", "wrong"),
            ("verify_said_clean_but_failed", "vclean_fail"), ("write_errors", "wr_err"), ("flush_false", "flushF"),
            ("lmdb_errors", "lmdb_err"), ("verify_found", "vfound"), ("audit_failed", "auditF"),
            ("blocks_missed", "missed"), ("no_effect", "noeffect")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts (~60 page flips) unless given")
    ap.add_argument("--blocks", type=int, default=560, help="blocks put into the attacked store (~3 MiB)")
    ap.add_argument("--flips", type=int, help="page-flip trials, spread over the page kinds (default 520)")
    ap.add_argument("--header-bias", type=float, default=0.4, help="share of flips aimed at header fields")
    ap.add_argument("--truncations", type=int)
    ap.add_argument("--swaps", type=int)
    ap.add_argument("--kills", type=int)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--hang-timeout", type=float, default=60, help="seconds a trial's child may run")
    ap.add_argument("--flush-timeout", type=float, default=30, help="drain(timeout=) and put(timeout=) in a trial")
    ap.add_argument("--workers", type=int, default=2, help="trials run at once")
    ap.add_argument("--only", default="", help="comma-separated attacks to run (default all): "
                    "page_flip,truncate,swap,kill9,full_disk,read_errors")
    ap.add_argument("--kinds", default="", help="comma-separated page kinds to flip (default every kind the "
                    "store has; tools/lmdb_pages.py names them)")
    ap.add_argument("--keep-failed", help="keep the damaged store (before the run) of every trial that hung, "
                    "crashed, could not open or served wrong bytes, with its report, under this directory")
    ap.add_argument("--trials-jsonl", help="append every trial's plan and children's reports here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--self-check", action="store_true", help="only check the page classifier "
                    "(tools/lmdb_pages.py) against LMDB's own counts on the drill's store, then exit")
    args = ap.parse_args()
    if args.self_check:
        sys.exit(self_check())
    for k, v in (_QUICK if args.quick else _FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    only = set(filter(None, args.only.split(","))) or {"page_flip", "truncate", "swap", "kill9", "full_disk",
                                                        "read_errors"}
    rng = random.Random(args.seed)
    started = time.perf_counter()
    results: dict = {}
    base = Path(tempfile.mkdtemp(prefix="drill-base-"))
    try:
        known = populate_evicting(base / "kv", args.blocks)
        per_block = max(1, SMALL_CAP // max(1, len(known)))
        fresh = list(range(args.blocks, args.blocks + FRESH_BYTES // per_block))
        ctx = _forkserver()
        plans, pages = plan_flips(base / "kv", args.flips, args.header_bias, rng, args.kinds) if "page_flip" in only else ([], {})
        plans += [{"group": "truncate", "damage": "truncate"}] * (args.truncations if "truncate" in only else 0)
        plans += [{"group": "swap", "damage": "swap"}] * (args.swaps if "swap" in only else 0)
        tallies = run_trials(base / "kv", known, fresh, plans, args, ctx, args.seed)
        if "page_flip" in only:
            results["page_flip"] = {k: t.report() for k, t in sorted(tallies.items()) if k not in ("truncate", "swap")}
            results["store"] = {"pages_by_kind": pages, "blocks_stored": len(known), "fresh_blocks_per_trial": len(fresh)}
        for k in ("truncate", "swap"):
            if k in tallies:
                results[k] = tallies[k].report()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if "kill9" in only:
        results["kill9"] = attack_kill9(args.kills, rng)
    if "full_disk" in only:
        results["full_disk"] = attack_full_disk()
    if "read_errors" in only:
        results["read_errors"] = attack_read_errors(args.requests)
    damage = [*results.get("page_flip", {}).values(), *(results[k] for k in ("truncate", "swap") if k in results)]
    total = {k: sum(r.get(k, 0) for r in damage) for k in _COUNTS}
    summary = {"damage_trials": total["trials"], "hangs": total["hang"],
               "crashes": total["crash"] + sum(results.get(k, {}).get("crashes", 0) for k in ("full_disk",)),
               "cannot_reopen": total["cannot_reopen"], "wrong_bytes_served": total["wrong_bytes_served"],
               "open_failed": total["open_failed"], "moved_aside": total["moved_aside"],
               "verify_said_clean_but_failed": total["verify_said_clean_but_failed"],
               "write_errors": total["write_errors"], "no_effect": total["no_effect"],
               "acknowledged_blocks_lost": results.get("kill9", {}).get("acknowledged_blocks_lost"),
               "requests_failed_not_causing_the_fault": results.get("read_errors", {}).get("failed"),
               "elapsed_s": round(time.perf_counter() - started, 1)}
    report = {"attacks": results, "summary": summary, "args": vars(args)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_report(results, summary)


def print_report(results: dict, summary: dict) -> None:
    rows = [*results.get("page_flip", {}).items(), *((k, results[k]) for k in ("truncate", "swap") if k in results)]
    if rows:
        if "store" in results:
            print(f"store: {results['store']['blocks_stored']} blocks, pages by kind {results['store']['pages_by_kind']}")
        print(f"{'damage':<18}" + "".join(f"{short:>{len(short) + 2}}" for _, short in _COLUMNS))
        for name, r in rows:
            print(f"{name:<18}" + "".join(f"{r.get(k, 0):>{len(short) + 2}}" for k, short in _COLUMNS))
        print("\nfailures seen (first distinct per kind; count x what @ where):")
        for name, r in rows:
            for f in r["failures"][:4]:
                print(f"  {name:<18} {f['count']:>3} x [{f['phase']}/{f['step']}] {f['what'][:150]}\n"
                      f"  {'':<18}       @ {f['where'][:200]}")
    for name in ("kill9", "full_disk", "read_errors"):
        if name in results:
            print(f"{name:<12} " + ", ".join(f"{k}={v}" for k, v in results[name].items()))
    print("summary      " + ", ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
