"""How long a step's forward took on its device, handed to whoever fits it (engine/prefill_model.py).

Knows: on CPU, the host clock around the forward (the forward runs to its end before it
returns); on CUDA, a pair of timing events recorded on the current stream around the forward's
launches, whose elapsed time is read only once the end event has completed -- checked without
waiting (`Event.query`) after the step's existing sync (the sampler's one read) and at the next
step's start, so the GPU time is measured, not the launch time, and no sync is added: a step
that produced no token (a prefill chunk that is not its prompt's last) is read after a later
step's sync. Doesn't know: what a step's work was (the caller hands it over with the mark).

Owned by the engine thread (and by engine/calibration.py before that thread starts).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

Sink = Callable[[list[tuple[int, int]], float], None]
MAX_PENDING = 64          # CUDA steps awaiting their end event; older ones are dropped unmeasured


class StepTimer:
    def __init__(self, device: torch.device, sink: Sink) -> None:
        self.cuda = device.type == "cuda"
        self.sink = sink
        self._pending: deque = deque()       # (start event, end event, work), oldest first

    def start(self) -> object:
        """A mark before the forward's launches."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, mark: object, work: list[tuple[int, int]]) -> None:
        """After the forward's launches: on CPU the step is measured now, on CUDA once its end
        event has completed (collect)."""
        if not self.cuda:
            self.sink(work, time.perf_counter() - mark)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((mark, end, work))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def collect(self) -> None:
        """Hand over every CUDA step whose end event has completed (never waits)."""
        while self._pending and self._pending[0][1].query():
            start, end, work = self._pending.popleft()
            self.sink(work, start.elapsed_time(end) / 1000.0)

    def measure(self, fn: Callable[[], torch.Tensor]) -> float:
        """Seconds `fn`'s device work takes, waited for (calibration at start, never a step)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
