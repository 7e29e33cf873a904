"""Issue 8, item 3: billing off the engine thread, with group commit, still exactly once and
still committed before the caller sees the result."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from engine.billing import Ledger
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def test_the_engine_thread_never_writes_the_ledger_and_finished_requests_share_commits(tmp_path) -> None:
    with make_engine(tmp_path) as eng:
        ledger = eng.ledger
        commit = ledger.record_many
        writers: list[str] = []

        def slow_commit(entries):
            # A slow disk: each fsync takes 50 ms, so requests finishing meanwhile queue up.
            writers.append(threading.current_thread().name)
            time.sleep(0.05)
            return commit(entries)
        ledger.record_many = slow_commit
        prompts = [random_prompt(9 + i, seed=200 + i) for i in range(12)]
        outs = [None] * len(prompts)

        def one(i):
            outs[i] = eng.generate(prompts[i], SamplingParams(max_tokens=2 + i % 3), tenant=f"t{i % 2}")
            # The caller holds its result: the ledger must already hold its bill.
            assert ledger.has(outs[i].request_id)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(o is not None for o in outs)
        assert set(writers) == {"tieredkv-billing"}           # never the engine thread
        assert eng.billing.entries == len(prompts) and eng.billing.groups < len(prompts)   # grouped
        bills = [ledger.tenant(f"t{k}") for k in range(2)]
        assert sum(b.requests for b in bills) == len(prompts)
        assert sum(b.prompt_tokens for b in bills) == sum(len(p) for p in prompts)
        ledger.check()


def test_kill_9_under_load_loses_no_answered_request_and_counts_none_twice(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(f"""
        import threading
        from pathlib import Path
        from tests.engine.conftest import make_engine, random_prompt
        from tieredkv import SamplingParams
        eng = make_engine(Path({str(tmp_path)!r}))
        lock = threading.Lock()

        def worker(k):
            i = 0
            while True:
                out = eng.generate(random_prompt(6 + i % 5, seed=k * 1000 + i), SamplingParams(max_tokens=2),
                                   tenant="t%d" % k)
                with lock:
                    print(out.request_id, flush=True)    # answered: the caller holds the result
                i += 1
        for k in range(4):
            threading.Thread(target=worker, args=(k,), daemon=True).start()
        threading.Event().wait()
        """)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    answered = []
    try:
        for line in child.stdout:
            answered.append(line.strip())
            if len(answered) == 60:
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    answered += [ln.strip() for ln in child.stdout.read().splitlines() if ln.strip()]
    assert child.returncode == -signal.SIGKILL and len(answered) >= 60
    with Ledger(tmp_path / "billing") as led:
        led.check()                                                   # sums == the records
        recorded = [rid for rid, _ in led.records()]
        assert len(recorded) == len(set(recorded))
        assert set(answered) <= set(recorded)                         # no answered request lost
        assert sum(led.tenant(f"t{k}").requests for k in range(4)) == len(recorded)
