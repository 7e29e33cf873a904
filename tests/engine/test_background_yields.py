"""Issue 28, item 9: the engine tells background pools when sequences run (storage/foreground.py).

While a request decodes, the process's foreground signal is held and the disk writer's encode
pool is one block wide; once no sequence runs (and after close) the signal is clear and the pool
is as wide as its threads. Real engine, real disk tier; the hang guard is the only clock.
"""
from __future__ import annotations

import time

from engine.sampling_params import SamplingParams
from storage.foreground import FOREGROUND
from tests.engine.conftest import make_engine, random_prompt


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + 60.0         # a hang guard, not a bound on anything
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.002)


def test_the_signal_is_held_while_a_request_decodes_and_cleared_when_none_runs(tmp_path) -> None:
    eng = make_engine(tmp_path)
    try:
        width = eng.cache.disk._writer.encode_width
        width_full = width.full
        assert width_full >= 1
        wait_until(lambda: not FOREGROUND.active(), "no foreground before any request")
        seen = []
        # Looked at from the 2nd token to the 6th of 200: the signal is set at the top of the step
        # after the one that admitted the request (that step made the 1st token), and cleared only
        # after the step that makes the last.
        for i, chunk in enumerate(eng.stream(random_prompt(12, 1), SamplingParams(max_tokens=200, ignore_eos=True))):
            if 1 <= i <= 5:
                seen.append((FOREGROUND.active(), width.limit()))
        assert seen == [(True, 1)] * 5
        wait_until(lambda: not FOREGROUND.active(), "the signal cleared once the request finished")
        assert width.limit() == width_full
        eng.generate(random_prompt(12, 2), SamplingParams(max_tokens=3))
    finally:
        eng.close()
    assert not FOREGROUND.active()
