"""One fault-drill trial's phases in child processes: the run (open, verify, read, put, flush,
read back, close) and the reopen (open, check, read, close), each forked from the drill's
forkserver, its progress and errors written to a JSON file after every step, killed with every
thread's stack when it outlives its timeout, and its crash read from faulthandler's output.
Knows nothing of how the store was damaged or how outcomes are counted (tools/drill_damage.py,
tools/drill_tally.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmdb  # noqa: E402

from drill_store import REPO, make_block, make_key, same  # noqa: E402
from storage.disk.tier import DiskTier  # noqa: E402

# -- one trial in two child processes ------------------------------------------------------------
#
# The children are forked from a forkserver that imported tools/fault_drill.py (torch, lmdb, the tier)
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
        progress.set(flushed=t.drain(timeout=flush_timeout))
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
    # drill_trial by its name (never __main__): the forkserver has it imported (through fault_drill)
    p = ctx.Process(target=_child_main, args=(fn, args, str(out), str(err)))
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


