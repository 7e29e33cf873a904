"""The engine's figures measured at start, so that its first request is planned from them.

Knows: the compute calibration -- one real prefill chunk (CALIBRATION_TOKENS, or the scheduler's
chunk if smaller, or what the pool and context hold) and a decode step after it, of the real
model in the real paged pool, after warm-up passes of each shape (a first call's one-time costs
are not a step's); its pages are allocated from the pool and released after, never registered
(no block of it is findable), and nothing is billed -- fed to the prefill model
(engine/prefill_model.py) -- and, with a remote tier, the link probe
(storage/remote/link_probe.py: a round trip and a block-sized read of the real store) fed to the
restore rates as the remote tier's seed (source "link probe"). Host and disk are seeded by the
cache itself (storage/restore_rates.py's calibrate).
Each figure is the best pass of a settled run (`settled_min`): passes repeat until SETTLE_PASSES
in a row no longer beat the best by SETTLE_GAIN (at most MAX_PASSES): a busy machine only ever
makes a pass slower, so a spell of contention at start is waited out, not taken as the figure.
Doesn't know: scheduling, billing, or what the figures decide (engine/restore_planner.py).

Threads: the compute calibration runs on the engine thread itself (`start_engine_thread`), as its
first work, before it takes a request: the figure is of the thread that runs the steps. Measured
on this 2-core CPU under load (issue 27, docs/BENCHMARKS.md): the same 256-token pass read
3.5-21 s on the thread that loaded the model and 0.3-1.2 s on another thread (libgomp's teams are
per calling thread; the loading thread's spins against the machine's other work), so a figure
timed on the building thread was 10-30x the steps it predicts. The building thread waits for it
and starts nothing meanwhile; the link probe starts after it (never beside the timed passes), on
its own thread (`tieredkv-link-probe`): each of its calls is bounded by the store's timeout, and
the start waits for it at most LINK_WAIT_CALLS timeouts; a store that does not answer by then
leaves the remote without a figure (its hits are recomputed: "no figures") until the probe's
answer lands, rather than holding the engine's start longer. It touches only the remote tier and
the rates (both thread-safe); `join` waits for it (bounded).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from engine.prefill_model import PrefillModel
from engine.sampling_params import SamplingParams
from engine.sequence import Scheduled
from engine.sequence import Sequence
from engine.step_timer import StepTimer
from storage.tiered_cache import TieredKVCache

log = logging.getLogger("tieredkv.calibration")

CALIBRATION_TOKENS = 256
LINK_WAIT_CALLS = 4        # the start waits for the link probe at most this many store timeouts
WARMUP_TOKENS = 16
SETTLE_PASSES = 2          # passes in a row that do not beat the best: the best is the figure
SETTLE_GAIN = 0.10         # "beat": faster than the best by more than this fraction
MAX_PASSES = 8             # per figure, whatever the machine does


@dataclass(frozen=True, slots=True)
class ComputeCalibration:
    prefill_tokens: int
    prefill_s: float
    decode_context: int          # the decode step's context (the chunk + its token)
    decode_s: float


def calibrate_compute(runner, cache: TieredKVCache, model: PrefillModel, timer: StepTimer, *, vocab_size: int,
                      chunk_tokens: int, max_context: int) -> ComputeCalibration | None:
    """Time one prefill chunk and one decode step on the real model and pool, and give them to
    `model`. None (nothing measured) when the pool or the context has no room for a chunk."""
    bs = cache.layout.block_size
    with cache.tiers.lock:
        free_tokens = cache.pool.num_free * bs
    n = min(CALIBRATION_TOKENS, chunk_tokens, max_context - 2, free_tokens - bs)
    if n < 2:
        return None
    seq = Sequence(request_id="calibration", prompt_ids=[], params=SamplingParams(max_tokens=1),
                   tenant="default", namespace=b"\0" * 32, block_size=bs, max_len=n + 1)
    if not cache.grow(seq.blocks, cache.growth(seq.blocks, 0, n + 1)):
        return None
    try:
        g = torch.Generator().manual_seed(0)
        seq.prompt_ids = torch.randint(0, vocab_size, (n + 1,), generator=g).tolist()

        def run(start: int, count: int) -> None:
            seq.num_computed = start
            runner.forward([Scheduled(seq, count)]).float().sum().item()   # waits for the pass
        run(0, 1)                                 # warm-up: first-call costs of a decode's path...
        run(0, min(n, WARMUP_TOKENS))             # ...and of a prefill's (its groups, masks)
        # ...and of the chunk's own shapes: the first pass of a size pays once for what a step
        # never pays again (weights faulted in from their mmap'd file, bf16 kernels generated
        # for the shape: 10-30x a step on a CPU, measured with the default model).
        run(0, n)
        # A settled best: a busy machine only ever makes a pass slower, and a figure too
        # pessimistic sends every hit to a load (and stretches its deadline) until the steps
        # correct it.
        prefill_s = settled_min(lambda: timer.measure(lambda: run(0, n)))
        decode_s = settled_min(lambda: timer.measure(lambda: run(n, 1)))
    finally:
        cache.finish(seq.blocks)                                # free again: never registered
    model.calibrate(n, prefill_s, n + 1, decode_s)
    return ComputeCalibration(n, prefill_s, n + 1, decode_s)


def settled_min(measure: Callable[[], float]) -> float:
    """The fastest of repeated `measure()` passes, repeated until SETTLE_PASSES in a row no longer
    beat the best by SETTLE_GAIN, or MAX_PASSES: at least SETTLE_PASSES + 1 passes; a burst of
    slow passes at the start is outlasted (each faster pass starts the count again)."""
    best, calm, passes = measure(), 0, 1
    while calm < SETTLE_PASSES and passes < MAX_PASSES:
        t = measure()
        passes += 1
        calm = 0 if t < best * (1 - SETTLE_GAIN) else calm + 1
        best = min(best, t)
    return best


def start_engine_thread(engine, loop: Callable[[], None]) -> threading.Thread:
    """Start the engine thread; with `engine.config.calibrate` it times the compute calibration
    first (its own passes, nothing else of ours running: this thread waits for it), then the link
    probe runs, waited for a bounded time. Sets `engine.calibration` and `engine.link_calibration`;
    a calibration that raised is raised here (the thread ends without serving)."""
    engine.calibration = engine.link_calibration = None
    calibrated, failed = threading.Event(), []

    def run() -> None:
        try:
            if engine.config.calibrate:
                engine.calibration = calibrate_compute(
                    engine.runner, engine.cache, engine.prefill_model, engine.step_timer,
                    vocab_size=engine.loaded.model.config.vocab_size, chunk_tokens=engine.planner.chunk_tokens,
                    max_context=engine.max_context)
        except BaseException as e:      # noqa: BLE001 -- handed to the building thread, raised there
            failed.append(e)
        finally:
            calibrated.set()
        if not failed:
            loop()
    thread = threading.Thread(target=run, name="tieredkv-engine", daemon=True)
    thread.start()
    calibrated.wait()
    if failed:
        thread.join()
        raise failed[0]
    if engine.config.calibrate and linked_to_probe(engine.cache):
        engine.link_calibration = start_link_probe(engine)
    return thread


def linked_to_probe(cache: TieredKVCache) -> list:
    """The tiers whose first figure is their link's (TierKind.calibrates == "link")."""
    return [t for t in cache.tiers.lower if t.kind.calibrates == "link"]


def start_link_probe(engine) -> "LinkCalibration":
    """The remote tier's link probe, after the compute calibration, waited for a bounded time."""
    link = LinkCalibration(engine.cache)
    # Waited for, bounded: without the link's figure a remote hit is recomputed (the planner
    # never loads blind), so a start that returns before it answers gives its first requests a
    # miss's time. A few calls each bounded by the store's timeout; a dead store holds the start
    # that long at most, and its figure lands whenever it answers.
    link.join(timeout=LINK_WAIT_CALLS * engine.config.remote_timeout_s)
    return link


class LinkCalibration:
    """The link probes of the tiers over a link (TierKind.calibrates == "link": the remote
    store's), one after another on a thread of its own, started at once. `figures`: the first
    such tier's (LinkFigures), once measured."""

    def __init__(self, cache: TieredKVCache) -> None:
        self.cache = cache
        self.figures = None               # LinkFigures once measured (written by the probe thread)
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tieredkv-link-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for tier in linked_to_probe(self.cache):
                try:
                    figures = tier.link_probe()
                    if figures is None:
                        log.warning("%s tier: the link probe got no answer; its first hits load unplanned", tier.name)
                        continue
                    self.cache.tiers.rates.seed(tier.name, figures.bytes_per_s, figures.rtt_s, source="link probe",
                                                points=figures.points())
                    if self.figures is None:
                        self.figures = figures
                except Exception:        # noqa: BLE001 -- a probe is a nicety: the tier works without it
                    log.exception("the %s tier's link probe failed", tier.name)
        finally:
            self.done.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return self.done.is_set()
