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
                         wrong, missed), put ~1.2 MiB of new blocks (evictions), flush(timeout),
                         read them back, close();
                 reopen  open a writable DiskTier again (a restart), check(), read every block,
                         close().
  truncate     data.mdb cut at a random length: the same trial.
  swap         payloads rotated among keys (what a damaged page pointer does): the same trial.
  kill9        a writer process killed with SIGKILL at a random moment, again and again; after each,
               the store must open, pass check() and verify(), and hold every block the writer had
               acknowledged (flush() returned) before it died.
  full_disk    writes into a small tmpfs until it is full: no crash, flush() False, the store
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
                  write_errors_blocks); flush_false: flush(timeout) returned False
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
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import lmdb  # noqa: E402
import torch  # noqa: E402

from storage.disk.tier import DiskTier  # noqa: E402
from storage.hashing import BlockKey, hash_block, root_hash  # noqa: E402

NAMESPACE = b"\x07" * 32
SHAPE = (2, 2, 16, 3, 8)
CAP = 256 << 20
SMALL_CAP = 1 << 20          # the page-flip store's capacity: eviction runs
FRESH_BYTES = 1200 << 10     # new blocks each trial puts (past the capacity: evictions)

# The child scripts below import these helpers from this module (tools/ on their path).


def make_key(i: int) -> BlockKey:
    parent = root_hash(NAMESPACE)
    tokens = tuple(range(16 * i, 16 * i + 16))
    return BlockKey(hash_block(parent, tokens), parent, tokens, NAMESPACE)


def make_block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int32), b.view(torch.int32))


def child(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


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


def populate_evicting(path: str | Path, blocks: int, capacity: int = SMALL_CAP) -> list[int]:
    """Put `blocks` blocks into a store of `capacity`, the first three quarters at twice the
    capacity (the drop to `capacity` then frees many pages at once: the free-page database
    grows a branch page), with reads between batches (the `lru` database churns). Returns the
    indices stored at the end."""
    quiet = logging.getLogger("storage.disk")
    level, quiet.level = quiet.level, logging.ERROR      # the capacity change is warned about
    try:
        first = blocks * 3 // 4
        with DiskTier(str(path), 2 * capacity) as t:
            for i in range(first):
                t.put(make_key(i), make_block(i))
                if i % 50 == 49:
                    t.flush()
                    for j in range(i - 40, i, 3):
                        t.get(make_key(j))
        with DiskTier(str(path), capacity) as t:
            for i in range(first, blocks):
                t.put(make_key(i), make_block(i))
            t.flush()
            for j in range(max(0, first - 100), first, 2):
                t.get(make_key(j))
            t.flush()
            return [i for i in range(blocks) if t.contains(make_key(i))]
    finally:
        quiet.level = level


# -- one trial in two child processes ------------------------------------------------------------
#
# The children are forked from a forkserver that imported this module (torch, lmdb, the tier)
# once: a trial costs its work, not an interpreter start. Each child writes its progress to a
# JSON file after every step, so a hung or crashed child still says how far it got.

class _Progress:
    """The child's report, rewritten after every change (the main thread's steps, and errors the
    tier logs from its own threads)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.d: dict = {"step": None, "errors": [], "seconds": {}}
        self._t = time.perf_counter()
        self._lock = threading.Lock()

    def step(self, name: str) -> None:
        with self._lock:
            now = time.perf_counter()
            if self.d["step"] is not None:
                self.d["seconds"][self.d["step"]] = round(now - self._t, 3)
            self.d["step"], self._t = name, now
            self._save()

    def set(self, **kw: object) -> None:
        with self._lock:
            self.d.update(kw)
            self._save()

    def error(self, where: str, e: BaseException, tb=None) -> None:
        self.add_error(_describe(where, e, tb))

    def add_error(self, d: dict) -> None:
        with self._lock:
            errs = self.d["errors"]
            if len(errs) < 50 and d not in errs:
                errs.append(d)
                self._save()

    def _save(self) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f)
        os.replace(tmp, self.out)


def _repo_frames(frames) -> str:
    """'file.py:func:line > ...' for the frames in this repository (outermost first, last 4)."""
    out = []
    for fr in frames:
        p = Path(fr.filename)
        if str(p).startswith(str(REPO)) and "tools" not in p.parts[-2:-1]:
            out.append(f"{p.name}:{fr.name}:{fr.lineno}")
    return " > ".join(out[-4:])


def _describe(step: str, e: BaseException, tb=None) -> dict:
    frames = traceback.extract_tb(tb if tb is not None else e.__traceback__)
    return {"step": step, "what": f"{type(e).__name__}: {e}"[:300], "where": _repo_frames(frames),
            "lmdb": isinstance(e, lmdb.Error) or "MDB_" in str(e)}


class _LogCapture(logging.Handler):
    """The tier's logged errors (its writer and deletes catch and log exceptions)."""

    def __init__(self, progress: _Progress) -> None:
        super().__init__(logging.ERROR)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.exc_info and record.exc_info[1] is not None:
                d = _describe(f"log:{record.name}", record.exc_info[1], record.exc_info[2])
            else:
                msg = record.getMessage()
                d = {"step": f"log:{record.name}", "what": msg[:300], "where": f"{record.module}:{record.funcName}",
                     "lmdb": "MDB_" in msg}
            self.progress.add_error(d)
        except Exception:
            pass


def _child_main(fn_name: str, args: tuple, out: str, err: str) -> None:
    import faulthandler
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    errf = os.fdopen(fd, "w")
    faulthandler.enable(file=errf, all_threads=True)            # SIGSEGV/SIGBUS/SIGABRT: the stacks
    faulthandler.register(signal.SIGUSR1, file=errf, all_threads=True)   # the parent's "you hung"
    progress = _Progress(out)
    root = logging.getLogger()
    root.handlers[:] = [_LogCapture(progress)]
    root.setLevel(logging.ERROR)
    try:
        globals()[fn_name](progress, *args)
        progress.set(done=True)
    except BaseException as e:   # a step's own errors are caught in the step; this is the rest
        progress.error("child", e)
        progress.set(done=True)
    errf.flush()
    os._exit(0)   # no atexit joins (a stuck thread must not turn a finished child into a hang)


def _read(t: DiskTier, indices, progress: _Progress, prefix: str) -> None:
    right = wrong = missed = 0
    for i in indices:
        try:
            got = t.get(make_key(i))
        except Exception as e:
            progress.error(f"{prefix}get", e)
            missed += 1
            continue
        if got is None:
            missed += 1
        elif same(got, make_block(i)):
            right += 1
        else:
            wrong += 1
    progress.set(**{f"{prefix}right": right, f"{prefix}wrong": wrong, f"{prefix}missed": missed})


def _open(path: str, capacity: int, progress: _Progress) -> DiskTier | None:
    progress.step("open")
    try:
        t = DiskTier(path, capacity)
    except Exception as e:
        progress.error("open", e)
        progress.set(opened=False)
        return None
    progress.set(opened=True, recovered=t.recovered)
    return t


def _close(t: DiskTier, progress: _Progress) -> None:
    progress.step("close")
    try:
        t.close()
    except Exception as e:
        progress.error("close", e)
    progress.step("closed")


def phase_run(progress: _Progress, path: str, known: list[int], fresh: list[int], capacity: int,
              flush_timeout: float) -> None:
    t = _open(path, capacity, progress)
    if t is None:
        return
    progress.step("verify")
    try:
        rep = t.verify()
        progress.set(verify_damaged=len(rep.damaged), verify_reasons=sorted({d.reason for d in rep.damaged})[:3])
    except Exception as e:
        progress.error("verify", e)
    progress.step("read")
    _read(t, known, progress, "")
    progress.step("put")
    for n, i in enumerate(fresh):
        try:
            if not t.put(make_key(i), make_block(i), timeout=flush_timeout):
                progress.set(put_timed_out=n)
                break
        except Exception as e:
            progress.error("put", e)
            break
    progress.step("flush")
    try:
        progress.set(flushed=t.flush(timeout=flush_timeout))
    except Exception as e:
        progress.error("flush", e)
    try:
        s = t.stats()
        progress.set(write_errors=s.write_errors, read_errors=s.read_errors, corrupt=s.corrupt, evictions=s.evictions)
    except Exception as e:
        progress.error("stats", e)
    progress.step("read_new")
    _read(t, fresh, progress, "new_")
    _close(t, progress)


def phase_reopen(progress: _Progress, path: str, indices: list[int], capacity: int, flush_timeout: float) -> None:
    t = _open(path, capacity, progress)
    if t is None:
        return
    progress.step("check")
    try:
        problems = t.check()
        progress.set(audit_problems=len(problems), audit_first=problems[:2])
    except Exception as e:
        progress.error("check", e)
    progress.step("read")
    _read(t, indices, progress, "")
    _close(t, progress)


_FH_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FH_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def _stacks(text: str) -> list[str]:
    """faulthandler's dump -> one 'file:func:line > ...' chain (repo frames) per thread that is
    inside the repository's code and not just waiting on a condition; the crashing thread first."""
    threads: list[tuple[bool, list]] = []
    for line in text.splitlines():
        if _FH_THREAD.match(line):
            threads.append((line.startswith("Current"), []))
        elif threads and (m := _FH_FRAME.match(line)):
            threads[-1][1].append((m.group(1), int(m.group(2)), m.group(3)))
    chains = []
    for _, frames in sorted(threads, key=lambda t: not t[0]):
        repo = [f for f in frames if f[0].startswith(str(REPO)) and "/tools/" not in f[0]]
        if repo and not (frames[0][2] == "wait" and "threading.py" in frames[0][0]):
            chains.append(" > ".join(f"{Path(f[0]).name}:{f[2]}:{f[1]}" for f in reversed(repo[:5])))
    return chains


def _crash_message(text: str) -> str:
    """What the C library or LMDB said before the abort ('double free or corruption', an
    'Assertion ... failed'), or faulthandler's 'Fatal Python error' line."""
    before = text.split("Fatal Python error")[0].strip().splitlines()[-2:]
    fatal = re.search(r"Fatal Python error: .*", text)
    return "; ".join(before) or (fatal.group(0) if fatal else "")


def run_child(ctx, fn: str, args: tuple, workdir: Path, timeout: float) -> dict:
    out, err = workdir / f"{fn}.json", workdir / f"{fn}.err"
    import fault_drill      # this module by its name (not __main__): the forkserver has it imported
    p = ctx.Process(target=fault_drill._child_main, args=(fn, args, str(out), str(err)))
    p.start()
    p.join(timeout)
    hung = p.is_alive()
    if hung:
        os.kill(p.pid, signal.SIGUSR1)        # faulthandler dumps every thread's stack
        time.sleep(1.0)
        p.kill()
        p.join()
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):
        res = {"step": None, "errors": []}
    text = err.read_text(errors="replace") if err.exists() else ""
    for e in res["errors"]:      # the trial's directory in messages: one signature for every trial
        e["what"] = e["what"].replace(str(workdir), "<trial>")
    if hung:
        res["hang"] = True
        res["errors"].append({"step": res.get("step"), "what": f"hang in step {res.get('step')!r} (killed after {timeout:.0f} s)",
                              "where": " | ".join(_stacks(text)[:2]) or "no repo frame on any thread", "lmdb": False})
    elif not res.get("done"):
        code = p.exitcode
        why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        res["crash"] = why
        said = _crash_message(text)
        res["errors"].append({"step": res.get("step"), "what": f"crash ({why}) in step {res.get('step')!r}"
                              + (f": {said[:200]}" if said else ""),
                              "where": " | ".join(_stacks(text)[:2]) or text.split("Extension modules:")[0].strip()[-300:],
                              "lmdb": False})
    return res


# -- damage -----------------------------------------------------------------------------------

def aim(pm, data: bytes, kind: str, pgno: int, rng: random.Random, header_bias: float) -> tuple[int, str]:
    """(offset in the file, field) of the byte to hit on page `pgno` of `kind`."""
    ps = pm.page_size
    base = pgno * ps
    header = rng.random() < header_bias

    def pick(field: str, lo: int, hi: int) -> tuple[int, str]:
        return base + rng.randrange(lo, max(lo + 1, hi)), field
    if kind.startswith("metapage"):
        if header:
            return pick(*rng.choice([("pgno", 0, 8), ("flags", 10, 12), ("meta_dbs", 40, 136),
                                     ("meta_last_pg_txnid", 136, 152)]))
        return pick("meta", 16, 152)
    if kind.endswith("ovf_cont"):
        return pick("data", 0, ps)
    if kind.endswith("ovf_head"):
        if header:
            return pick(*rng.choice([("pgno", 0, 8), ("flags", 10, 12), ("ovf_count", 12, 16)]))
        return pick("data", 16, ps)
    if kind.endswith("_branch") or kind.endswith("_leaf"):
        lower, upper = int.from_bytes(data[base + 12:base + 14], "little"), int.from_bytes(data[base + 14:base + 16], "little")
        offsets = [int.from_bytes(data[base + o:base + o + 2], "little") for o in range(16, lower, 2)]
        if header or upper >= ps:
            field = rng.choice(["pgno", "flags", "lower_upper", "node_offsets", "node_header"])
            if field == "node_offsets" and lower > 16:
                return pick(field, 16, lower)
            if field == "node_header" and offsets:
                off = rng.choice(offsets)
                return pick(field, off, min(off + 8, ps))
            return pick(*{"pgno": ("pgno", 0, 8), "flags": ("flags", 10, 12)}.get(field, ("lower_upper", 12, 16)))
        return pick("nodes", upper, ps)
    return pick("any", 0, ps)    # free-listed or orphan pages: stale bytes


def flip_at(path: Path, at: int, bit: int) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << bit)]))


def truncate(path: Path, rng: random.Random) -> None:
    data = path / "data.mdb"
    os.truncate(data, rng.randrange(os.path.getsize(data)))


def swap_payloads(path: Path, rng: random.Random) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            keys = [k for k, _ in txn.cursor(db=db)]
            picked = rng.sample(keys, min(len(keys), 8))
            vals = [bytes(txn.get(k, db=db)) for k in picked]
            for k, v in zip(picked, vals[1:] + vals[:1]):
                txn.put(k, v, db=db)
    finally:
        env.close()


# -- trials and their tally -------------------------------------------------------------------

_COUNTS = ("trials", "hang", "crash", "open_failed", "cannot_reopen", "moved_aside", "wrong_bytes_served",
           "verify_said_clean_but_failed", "write_errors", "flush_false", "lmdb_errors", "audit_failed",
           "verify_found", "no_effect", "write_errors_blocks", "blocks_right", "blocks_missed")


def outcome(run: dict, reopen: dict, known: int) -> dict:
    """One trial's outcome flags from its two children's reports."""
    errors = run["errors"] + reopen["errors"]
    hang = bool(run.get("hang") or reopen.get("hang"))
    crash = bool(run.get("crash") or reopen.get("crash"))
    lmdb_err = any(e["lmdb"] for e in errors)
    after_verify = [e for e in run["errors"] if e["step"] not in ("open", "verify")]
    verify_clean = run.get("verify_damaged") == 0 and not run.get("recovered")
    run_failed = (any(e["lmdb"] for e in after_verify) or run.get("write_errors", 0) > 0
                  or run.get("hang") and run.get("step") != "verify" or run.get("crash") and run.get("step") != "verify")
    cannot_reopen = reopen.get("opened") is False or ((reopen.get("hang") or reopen.get("crash")) and reopen.get("step") == "open")
    wrong = run.get("wrong", 0) + run.get("new_wrong", 0) + reopen.get("wrong", 0)
    o = {
        "trials": 1, "hang": int(hang), "crash": int(crash),
        "open_failed": int(run.get("opened") is False),
        "cannot_reopen": int(bool(cannot_reopen)),
        "moved_aside": int(bool(run.get("recovered") or reopen.get("recovered"))),
        "wrong_bytes_served": wrong,
        "verify_said_clean_but_failed": int(bool(verify_clean and run_failed)),
        "write_errors": int(run.get("write_errors", 0) > 0),
        "write_errors_blocks": run.get("write_errors", 0),
        "flush_false": int(run.get("flushed") is False),
        "lmdb_errors": int(lmdb_err),
        "audit_failed": int(bool(reopen.get("audit_problems"))),
        "verify_found": int(bool(run.get("verify_damaged"))),
        "blocks_right": run.get("right", 0),
        "blocks_missed": run.get("missed", 0),
    }
    o["no_effect"] = int(not errors and not hang and not crash and run.get("right") == known and wrong == 0
                         and run.get("verify_damaged") == 0 and run.get("flushed") is True and not o["write_errors"]
                         and not o["moved_aside"] and reopen.get("audit_problems") == 0 and run.get("corrupt") == 0)
    return o


def _severity(f: dict) -> int:
    """Order of the failures in the report: hangs, crashes, failed opens, other errors, audit
    problems, then the stores moved aside (the tier doing its job)."""
    what = f["what"]
    return (0 if what.startswith("hang") else 1 if what.startswith("crash") else 2 if f["step"] == "open" else
            4 if what.startswith("audit:") else 5 if "moved aside" in what else 3)


class Tally:
    """Outcome counts and the first distinct failures of one group of trials (a page kind)."""
    MAX_FAILURES = 8

    def __init__(self) -> None:
        self.counts = Counter({k: 0 for k in _COUNTS})
        self.failures: dict[str, dict] = {}
        self.by_field: dict[str, Counter] = {}

    def add(self, o: dict, run: dict, reopen: dict, field: str | None = None) -> None:
        self.counts.update(o)
        if field is not None:
            c = self.by_field.setdefault(field, Counter())
            c["trials"] += 1
            c["no_effect"] += o["no_effect"]
            c["hang"] += o["hang"]
            c["failed"] += int(bool(o["hang"] or o["crash"] or o["open_failed"] or o["cannot_reopen"]
                                    or o["lmdb_errors"] or o["write_errors"]))
        audit = [{"step": "check", "what": f"audit: {reopen['audit_first'][0]}", "where": "integrity.py:audit"}] \
            if reopen.get("audit_first") else []
        for phase, errors in (("run", run["errors"]), ("reopen", reopen["errors"] + audit)):
            for e in errors:
                what = re.sub(r"\b[0-9a-f]{16}\b", "H", e["what"])
                sig = f"{phase}/{e['step']}: " + re.sub(r"0x[0-9a-f]+|\d+", "N", what)[:160] + " @ " + \
                    re.sub(r":\d+", "", e["where"])
                if sig in self.failures:
                    self.failures[sig]["count"] += 1
                elif len(self.failures) < self.MAX_FAILURES or _severity(e) <= 2:
                    self.failures[sig] = {"phase": phase, "step": e["step"], "what": e["what"], "where": e["where"],
                                          "count": 1}
                else:
                    self.counts["failures_not_kept"] += 1

    def report(self) -> dict:
        out = dict(self.counts)
        out["failures"] = sorted(self.failures.values(), key=lambda f: (_severity(f), -f["count"]))
        if self.by_field:
            out["by_field"] = {f: dict(c) for f, c in sorted(self.by_field.items())}
        return out


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


def plan_flips(base: Path, total: int, header_bias: float, rng: random.Random, only: str = ""
               ) -> tuple[list[dict], dict]:
    """`total` bit flips spread evenly over the page kinds the store has (or those in `only`)."""
    from lmdb_pages import classify
    pm = classify(str(base))
    data = (base / "data.mdb").read_bytes()
    wanted = set(filter(None, only.split(",")))
    kinds = {k: v for k, v in pm.by_kind().items() if k != "orphan" and (not wanted or k in wanted)}
    names = sorted(kinds)
    plans = []
    for j, kind in enumerate(names):
        for _ in range(total // len(names) + (j < total % len(names))):
            pgno = rng.choice(kinds[kind])
            at, field = aim(pm, data, kind, pgno, rng, header_bias)
            plans.append({"group": kind, "damage": "flip", "pgno": pgno, "at": at, "offset": at - pgno * pm.page_size,
                          "bit": rng.randrange(8), "field": field})
    return plans, {k: len(v) for k, v in sorted(pm.by_kind().items())}

WRITER = """
    import sys
    sys.path.insert(0, "tools")
    from fault_drill import make_block, make_key
    from storage.disk.tier import DiskTier
    t = DiskTier(sys.argv[1], 256 << 20, batch_blocks=8)
    i = int(sys.argv[2])
    while True:
        t.put(make_key(i), make_block(i))
        i += 1
        if i % 16 == 0:
            if t.flush():
                print(f"acked {i}", flush=True)
"""


def attack_kill9(kills: int, rng: random.Random) -> dict:
    out = {"kills": kills, "reopen_failures": 0, "audit_problems": 0, "verify_damage": 0,
           "acknowledged_blocks_lost": 0, "acknowledged_blocks": 0}
    work = Path(tempfile.mkdtemp(prefix="drill-kill9-"))
    try:
        acked = 0
        for k in range(kills):
            p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(work), str(acked)], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            deadline = time.monotonic() + rng.uniform(0.3, 1.5)
            last = acked
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                if line.startswith("acked"):
                    last = int(line.split()[1])
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            acked = last
            try:
                with DiskTier(str(work), CAP) as t:
                    out["audit_problems"] += len(t.check())
                    out["verify_damage"] += len(t.verify().damaged)
                    lost = sum(not same(t.get(make_key(i)), make_block(i)) for i in range(acked))
                    out["acknowledged_blocks_lost"] += lost
            except Exception:
                out["reopen_failures"] += 1
        out["acknowledged_blocks"] = acked
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def attack_full_disk() -> dict:
    mnt = Path(tempfile.mkdtemp(prefix="drill-tmpfs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(mnt, ignore_errors=True)
        return {"skipped": f"cannot mount a tmpfs here: {r.stderr.strip()[:120]}"}
    out = {"crashes": 0, "flush_said_complete_after_loss": 0, "reopened": False, "audit_problems": 0}
    try:
        res = child("""
            import json, sys
            sys.path.insert(0, "tools")
            from fault_drill import make_block, make_key
            from storage.disk.tier import DiskTier
            t = DiskTier(sys.argv[1], 64 << 20, map_size=64 << 20)     # the map is larger than the disk
            for i in range(1500):                   # ~9 MiB of blocks into a 4 MiB filesystem
                t.put(make_key(i), make_block(i))
            complete = t.flush()
            s = t.stats()
            t.close()
            print(json.dumps({"complete": complete, "write_errors": s.write_errors, "evictions": s.evictions}))
        """, mnt / "kv")
        if r.returncode != 0 and res.returncode != 0:
            out["crashes"] += 1
        elif res.returncode != 0:
            out["crashes"] += 1
            out["why"] = res.stderr[-300:]
        else:
            got = json.loads(res.stdout)
            out.update(got)
            out["flush_said_complete_after_loss"] = int(got["complete"] and got["write_errors"] > 0)
        with DiskTier(str(mnt / "kv"), 64 << 20) as t:
            out["reopened"] = True
            out["audit_problems"] = len(t.check())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)
    return out


def attack_read_errors(requests: int) -> dict:
    """Concurrent requests on a real tiny engine while every disk read fails."""
    import threading
    from transformers import LlamaConfig
    from engine.model import model_from_config
    from tieredkv import CacheConfig, Engine, SamplingParams

    class ReadsFail:
        def __init__(self, env):
            self._env = env

        def begin(self, *a, write=False, **kw):
            if not write:
                raise lmdb.ReadersFullError("MDB_READERS_FULL (injected)")
            return self._env.begin(*a, write=write, **kw)

        def __getattr__(self, name):
            return getattr(self._env, name)

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    prompts = [[(7 * i + j) % 128 for j in range(40)] for i in range(requests)]
    greedy = SamplingParams(max_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        cache = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=f"{tmp}/kv",
                            disk_capacity="64MiB")
        with Engine(model_from_config(config, seed=0), cache) as eng:
            expected = [eng.generate(p, greedy).token_ids for p in prompts]
            eng.cache.demote("device")
            eng.cache.demote("host")
            eng.cache.disk.flush()
            healthy = eng.cache.disk._gate._env
            eng.cache.disk._gate._env = ReadsFail(healthy)
            results: list = [None] * requests

            def one(i):
                try:
                    results[i] = eng.generate(prompts[i], greedy).token_ids
                except Exception as e:
                    results[i] = e
            threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            eng.cache.disk._gate._env = healthy
            read_errors = eng.cache.disk.stats().read_errors
    return {"requests": requests, "failed": sum(isinstance(r, Exception) for r in results),
            "wrong_tokens": sum(r != e for r, e in zip(results, expected) if not isinstance(r, Exception)),
            "read_errors_counted": read_errors}


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
    ap.add_argument("--flush-timeout", type=float, default=30, help="flush(timeout=) and put(timeout=) in a trial")
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
