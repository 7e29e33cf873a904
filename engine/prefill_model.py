"""How long this engine takes to compute new tokens, fitted from its own steps.

Knows: a step's time as a linear function of its work -- `a + b * new_tokens + c * attention`,
where `attention` sums new_tokens * context over the step's sequences (the quadratic part of
prefill) -- fitted by least squares over the last WINDOW steps (non-negative coefficients), and
the prediction for a prefill of n new tokens over a context. Doesn't know: the model or the
device (it measures them), or what the figure is used for (the compute-or-load planner of issue
18 will read it; today cache_status, /metrics and `tieredkv status` show it).

Owned by the engine thread (observe); predict/snapshot may run anywhere (a lock guards the fit).
"""
from __future__ import annotations

import threading
from collections import deque

import numpy as np

WINDOW = 512          # steps kept for the fit
MIN_STEPS = 8         # fewer than this: no fit yet
REFIT_EVERY = 32      # steps between fits


class PrefillModel:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)   # (new, attention, seconds)
        self._coef: tuple[float, float, float] | None = None
        self._since_fit = 0

    def observe(self, work: list[tuple[int, int]], seconds: float) -> None:
        """One step: (new tokens, context after the step) per sequence, and its forward's time."""
        new = sum(n for n, _ in work)
        if new <= 0 or seconds <= 0:
            return
        attention = float(sum(n * ctx for n, ctx in work))
        with self._lock:
            self._steps.append((float(new), attention, seconds))
            self._since_fit += 1
            if self._coef is None and len(self._steps) >= MIN_STEPS or self._since_fit >= REFIT_EVERY:
                self._fit()

    def _fit(self) -> None:
        rows = np.array(self._steps)
        x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        coef, *_ = np.linalg.lstsq(x, rows[:, 2], rcond=None)
        self._coef = tuple(max(0.0, float(c)) for c in coef)
        self._since_fit = 0

    def predict(self, new_tokens: int, context: int) -> float | None:
        """Seconds to compute `new_tokens` whose context ends at `context`, or None before a fit."""
        with self._lock:
            coef = self._coef
        return None if coef is None else _seconds(coef, new_tokens, context)

    def snapshot(self) -> dict:
        with self._lock:
            coef, steps = self._coef, len(self._steps)
        out = {"steps": steps, "fitted": coef is not None}
        if coef is not None:
            out.update(overhead_s=coef[0], per_token_s=coef[1], per_token_context_s=coef[2])
            out["prefill_2048_s"] = round(_seconds(coef, 2048, 2048), 4)
        return out


def _seconds(coef: tuple[float, float, float], new_tokens: int, context: int) -> float:
    # The same features as observe(): the attention term is new tokens x the context after them.
    a, b, c = coef
    return a + b * new_tokens + c * new_tokens * context
