"""How long this engine takes to compute new tokens, fitted from its own prefill steps.

Knows: a prefill step's time as `a + b * new_tokens + c * attention`, where `attention` is
new_tokens * the context after them (the quadratic part of prefill); the fit over the last
WINDOW prefill steps -- non-negative coefficients, relative errors (a 5 ms step counts as much
as a 2 s one), Huber-weighted and refitted (IRLS) so a few outliers (a loaded machine, a GC
pause) barely move it --, the calibration at start (engine/calibration.py: one prefill chunk and
one decode step, so there is a fit before the first request, scaled by the first real prefill
steps until the window is fitted), the prediction for a prefill of n
new tokens over a context, and the last ERRORS (predicted, observed) pairs of prefill steps.
Only prefill work is fitted: a step is kept when exactly one sequence prefills in it and decode
tokens (a sequence's one new token) are at most a DECODE_SHARE of its tokens; steps dominated by
decodes or shared by several prefills are not the planner's question (a hit's own prefill) and
would blur its answer.
Doesn't know: the model or the device (it measures them), or how a step was timed (the engine's
engine/step_timer.py: CUDA events on CUDA, the host clock on CPU).

Owned by the engine thread (observe, calibrate); predict/snapshot may run anywhere (a lock
guards the fit).
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

import numpy as np

WINDOW = 512          # prefill steps kept for the fit
MIN_STEPS = 8         # fewer than this (calibration included): the calibration's figures, or none
REFIT_EVERY = 32      # prefill steps between fits
DECODE_SHARE = 0.25   # a step with more decode tokens than this share of its prefill tokens is not fitted
ERRORS = 16           # (predicted, observed) pairs kept
HUBER_K = 1.345       # in robust standard deviations of the relative residuals
IRLS_ROUNDS = 6


class PrefillModel:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)   # (new, attention, seconds)
        self._coef: tuple[float, float, float] | None = None
        self._since_fit = 0
        self._skipped = 0                  # steps left out (decode-dominated or shared)
        self._errors: deque[tuple[float, float]] = deque(maxlen=ERRORS)
        self._calibration: dict | None = None
        self._fitted = False               # fitted from the window (not only the calibration)
        self._calibrated: tuple[float, float, float] | None = None   # the calibration's own figures
        self._ratios: list[float] = []     # observed / calibrated, per prefill step before the fit

    def observe(self, work: list[tuple[int, int]], seconds: float) -> None:
        """One step: (new tokens, context after the step) per sequence, and its time. A
        sequence with one new token is a decode (or a prompt's last token: either way a decode's
        cost)."""
        if seconds <= 0:
            return
        prefills = [(n, ctx) for n, ctx in work if n > 1]
        decodes = sum(n for n, _ in work if n == 1)
        with self._lock:
            if len(prefills) != 1 or decodes > DECODE_SHARE * prefills[0][0]:
                self._skipped += 1
                return
            new, ctx = prefills[0]
            if self._coef is not None:
                self._errors.append((_seconds(self._coef, new, ctx), seconds))
            self._steps.append((float(new), float(new * ctx), seconds))
            self._since_fit += 1
            if len(self._steps) >= MIN_STEPS and (not self._fitted or self._since_fit >= REFIT_EVERY):
                self._fit()
            elif not self._fitted and self._calibrated is not None:
                self._rescale(_seconds(self._calibrated, new, ctx), seconds)

    def calibrate(self, prefill_tokens: int, prefill_s: float, decode_context: int, decode_s: float) -> None:
        """The figures before any request: a step's overhead from one decode step (its one
        token's own cost is small beside it) and the per-token cost from one prefill chunk of
        `prefill_tokens` (from position 0); the attention term waits for real steps. The chunk
        stays in the window as a step; the fit takes over from MIN_STEPS steps."""
        if prefill_tokens <= 1 or prefill_s <= 0 or decode_s <= 0:
            return
        a = min(decode_s, prefill_s)
        b = max(prefill_s - a, 0.0) / prefill_tokens
        with self._lock:
            self._steps.append((float(prefill_tokens), float(prefill_tokens * prefill_tokens), prefill_s))
            self._steps.append((1.0, float(decode_context), decode_s))
            self._coef = self._calibrated = (a, b, 0.0)
            self._calibration = {"prefill_tokens": prefill_tokens, "prefill_s": round(prefill_s, 6),
                                 "decode_context": decode_context, "decode_s": round(decode_s, 6)}

    def _rescale(self, predicted: float, observed: float) -> None:
        """Before the window is fitted, the calibration's figures scaled by the median of what
        the real prefill steps took over what they predicted: one factor (all the few steps can
        tell), so a calibration a loaded start made 10x too slow is right from its first step."""
        self._ratios.append(observed / predicted if predicted > 0 else 1.0)
        factor = float(np.median(self._ratios))
        self._coef = tuple(c * factor for c in self._calibrated)

    def _fit(self) -> None:
        rows = np.array(self._steps)
        x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        coef = robust_nonneg_fit(x, rows[:, 2])
        if coef is not None:
            self._coef = tuple(float(c) for c in coef)
        self._since_fit, self._fitted = 0, True

    def predict(self, new_tokens: int, context: int) -> float | None:
        """Seconds to compute `new_tokens` whose context ends at `context`, or None before a fit."""
        with self._lock:
            coef = self._coef
        return None if coef is None else _seconds(coef, new_tokens, context)

    def snapshot(self) -> dict:
        with self._lock:
            coef, steps, skipped = self._coef, len(self._steps), self._skipped
            errors, calibration = list(self._errors), self._calibration
        out = {"steps": steps, "skipped_steps": skipped, "fitted": coef is not None}
        if calibration is not None:
            out["calibration"] = calibration
        if coef is not None:
            out.update(overhead_s=coef[0], per_token_s=coef[1], per_token_context_s=coef[2])
            out["prefill_2048_s"] = round(_seconds(coef, 2048, 2048), 4)
        if errors:
            out["recent"] = [{"predicted_s": round(p, 6), "observed_s": round(o, 6)} for p, o in errors]
            errs = sorted(abs(p - o) / o for p, o in errors)
            out["median_error"] = round(errs[len(errs) // 2], 4)
        return out


def robust_nonneg_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Coefficients >= 0 of y ~ x @ coef, minimizing Huber-weighted relative errors (IRLS): each
    row is scaled by 1 / y, and rows whose residual passes HUBER_K robust deviations weigh
    HUBER_K * deviation / |residual| (an outlier 20x the others counts as one a few deviations
    off, not as itself)."""
    keep = y > 0
    x, y = x[keep], y[keep]
    if len(y) == 0:
        return None
    xs, ys = x / y[:, None], np.ones_like(y)           # relative errors
    w = np.ones_like(y)
    coef = None
    for _ in range(IRLS_ROUNDS):
        coef = _nnls(xs * w[:, None], ys * w)
        r = ys - xs @ coef
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if scale <= 1e-12:
            break
        a = np.abs(r) / (HUBER_K * scale)
        w = np.sqrt(np.where(a <= 1.0, 1.0, 1.0 / np.maximum(a, 1e-12)))
    return coef


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, by trying every subset of the columns (three
    here) and keeping the best feasible one: exact, and cheap at this size."""
    k = x.shape[1]
    best, best_err = np.zeros(k), float(y @ y)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sub < 0):
                continue
            coef = np.zeros(k)
            coef[list(cols)] = sub
            err = float(np.sum((y - x @ coef) ** 2))
            if err < best_err * (1 - 1e-9):
                best, best_err = coef, err
    return best


def _seconds(coef: tuple[float, float, float], new_tokens: int, context: int) -> float:
    # The same features as observe(): the attention term is new tokens x the context after them.
    a, b, c = coef
    return a + b * new_tokens + c * new_tokens * context
