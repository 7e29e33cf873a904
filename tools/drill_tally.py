"""A fault-drill trial's outcome from its two children's reports (hang, crash, wrong bytes served,
...), and the tally of outcomes per damage kind with its first distinct failures. Knows nothing of
how the children ran or what damage was done.
"""
from __future__ import annotations

import re
from collections import Counter


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

