"""The graph-safe decode step: a pass where every sequence brings one new token, with static shapes
and its metadata in persistent buffers, replayed as a CUDA graph per batch bucket.

Knows: the batch buckets (powers of two up to max_seqs, and max_seqs), the persistent buffers of a
step's integers -- input ids, positions, write page and slot, context lengths ([S]) and block
tables ([S, W], W = the longest context's blocks as a power of two) -- updated in place before
each step (on CUDA: a pinned host mirror and one non-blocking copy into the device buffers, so
every captured graph reads the same addresses), and the step itself: the model's forward over
the first S rows of those buffers, the attention prepared inside it from them. Padding rows (a
batch of 5 runs bucket 8) write into a page reserved for them (`sink`) and attend to its first
slot alone; their logits are dropped.
The step runs from the embedding to the token ids: each row's argmax and NaN flag in the step
itself, and when any row samples, a second graph per bucket (`_tail`) draws every row at once
(engine/sampler.py's `race`, every stage over all rows) from its knobs (temperature, min-p, top-k,
top-p: float64 fields of the same buffers) and its Exp(1) noise, drawn into a persistent buffer
from the row's own generator before the replay (one kernel per sampled row, the one per-row
work: a seeded request draws exactly what the eager sampler draws for it).
Inside the step: no host sync, no data-dependent Python control flow, no tensor -> list: the
shapes depend only on the bucket. Modes:
- "static": the step run eagerly (the reference the others are compared with);
- "compile": torch.compile(fullgraph=True) of the same step, one graph per bucket (the CPU check
  that the step is graph-safe; also measurable on the CPU, tools/bench_throughput.py). Inductor,
  or $TIEREDKV_COMPILE_BACKEND (the tests' aot_eager: inductor's CPU compile takes ~1 min a bucket);
- "cuda_graph": each bucket warmed up then captured at start (torch.cuda.CUDAGraph, one memory
  pool shared by all buckets, largest first; a progress line each), then replayed.
Thread: everything here runs on the engine thread (ModelRunner's owner); the buffers are its own.
Doesn't know: scheduling, which rows may be drawn here (the step loop: engine/step_loop.py), the
logprobs or the host copy (engine/sampler.py's `packed_step`), or the tiers.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.paged_batch import Group
from engine.sampler import race

log = logging.getLogger("tieredkv.engine")

MODES = ("static", "compile", "cuda_graph")
FIELDS = ("ids", "positions", "write_pages", "write_slots", "context_len")
# float64 fields (their int64 slots viewed as float64): a row drawn here (1) or greedy (0), and
# the knobs engine/sampler.py's race reads, in its order.
KNOBS = ("draw", "temperature", "min_p", "top_k", "top_p")
GREEDY = (0.0, 1.0, 0.0, 0.0, 1.0)      # a greedy or padding row's knobs (its draw is not used)


def decode_buckets(max_seqs: int) -> list[int]:
    """The batch sizes a decode step runs: 1, 2, 4, ... below max_seqs, and max_seqs."""
    out, b = [], 1
    while b < max_seqs:
        out.append(b)
        b *= 2
    return out + [max_seqs]


def bucket_of(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


@dataclass
class DecodeBatch:
    """What paged_attention_forward reads (PagedBatch's attributes), over the persistent buffers."""
    kv: torch.Tensor
    block_size: int
    backend: Any
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    groups: list[Group]
    prepared: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step: its new token, and its page table after the step."""
    token: int
    context_len: int            # tokens of context including the new one
    pages: tuple[int, ...]
    # Drawn in the step: (temperature, min_p, top_k, top_p) (engine/sampler.py's draw_knobs) and
    # the request's generator; None: greedy (or the tokens are not wanted).
    draw: tuple[tuple[float, float, float, float], torch.Generator] | None = None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: torch.Tensor, block_size: int, backend: Any, *,
                 max_seqs: int, max_context: int, sink: int, mode: str = "static") -> None:
        if mode not in MODES:
            raise ValueError(f"decode step: expected one of {MODES}, got {mode!r}")
        if mode == "cuda_graph" and kv.device.type != "cuda":
            raise ValueError("decode step: cuda_graph needs a CUDA device")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.backend = backend
        self.mode = mode
        self.sink = sink
        self.device = kv.device
        self.buckets = decode_buckets(max_seqs)
        blocks = -(-max_context // block_size)
        self.width = max(2, 1 << (blocks - 1).bit_length())
        self.max_context = max_context
        smax = self.buckets[-1]
        n = smax * (len(FIELDS) + len(KNOBS) + self.width)
        self._dev = torch.zeros(n, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=True) if cuda else self._dev
        self._host_np = self._host.numpy()
        self._copied: torch.cuda.Event | None = None
        views = {name: self._dev[i * smax:(i + 1) * smax] for i, name in enumerate(FIELDS)}
        self._ids, self._positions = views["ids"], views["positions"]
        self._write_pages, self._write_slots, self._context = views["write_pages"], views["write_slots"], \
            views["context_len"]
        at = (len(FIELDS) + len(KNOBS)) * smax
        self._knobs = self._dev[len(FIELDS) * smax:at].view(torch.float64).view(len(KNOBS), smax)
        self._table = self._dev[at:].view(smax, self.width)
        # Each row's Exp(1) noise for a draw (float64, the logits' width), written before a replay.
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self._noise = torch.ones((smax, self.vocab), dtype=torch.float64, device=self.device)
        self.tokens: torch.Tensor | None = None   # the last run's token ids [n] and NaN flags [n]
        self.nan: torch.Tensor | None = None
        self._rows = torch.arange(smax, device=self.device)
        self._ones = torch.ones(smax, dtype=torch.int64, device=self.device)
        # A 4-D mask: transformers takes it as prepared (see ModelRunner).
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        # bucket -> (graph, (logits, greedy, nan)); the draw's graphs: bucket -> (graph, tokens)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.tails: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.drawn_steps = 0           # steps whose tokens were drawn in the step (any row sampled)
        self.steps = 0                 # decode steps run through here (tests, benchmarks)
        self.runs: dict[int, int] = {}  # steps per bucket
        self.compiles = 0              # graphs compiled ("compile" mode)
        self._fill_padding(smax, 0)
        if mode == "compile":
            # One graph per bucket (S is a constant of each); fullgraph: a graph break is an error.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(self.buckets) + 2)
            backend = os.environ.get("TIEREDKV_COMPILE_BACKEND", "inductor")

            def counted(gm, example_inputs):
                self.compiles += 1
                if backend == "inductor":
                    from torch._inductor.compile_fx import compile_fx
                    return compile_fx(gm, example_inputs)
                return torch._dynamo.lookup_backend(backend)(gm, example_inputs)
            self._compiled = torch.compile(self._step, backend=counted, fullgraph=True, dynamic=False)
            self._compiled_tail = torch.compile(self._tail, backend=counted, fullgraph=True, dynamic=False)

    # ---- the step -------------------------------------------------------------------------
    def _step(self, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits [S, vocab], argmax [S] and NaN flags [S] of the first S rows of the buffers.
        Shapes depend on S alone."""
        ctx = self._context[:S]
        rows = self._rows[:S]
        g = Group(S, 1, self.width * self.block_size, rows.view(S, 1), rows, rows, self._table[:S], ctx,
                  ctx - 1, self._ones[:S])
        batch = DecodeBatch(self.kv, self.block_size, self.backend, self._write_pages[:S], self._write_slots[:S], [g])
        batch.prepared = [self.backend.prepare(batch, g)]
        out = self.model(input_ids=self._ids[:S].unsqueeze(0), position_ids=self._positions[:S].unsqueeze(0),
                         attention_mask=self._mask, use_cache=False, tkv_batch=batch)
        logits = out.logits[0]
        return logits, torch.argmax(logits, dim=-1), torch.isnan(logits).any(dim=-1)

    def _tail(self, S: int, logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Token ids [S]: each drawn row's draw from its knobs and noise, the others' argmax."""
        knobs = self._knobs[:, :S]
        drawn = race(logits, knobs[1:], self._noise[:S])
        return torch.where(knobs[0] > 0, drawn, greedy)

    def whole(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step as one function (embedding to token ids and NaN flags): what
        tests/engine/test_decode_graph.py compiles fullgraph."""
        logits, greedy, nan = self._step(S)
        return self._tail(S, logits, greedy), nan

    # ---- the buffers ------------------------------------------------------------------------
    def _fill_padding(self, smax: int, start: int) -> None:
        """Rows start..smax-1 of the host mirror: padding (the sink page, one token of context)."""
        h, w = self._host_np, self.width
        for i, name in enumerate(FIELDS):
            value = {"ids": 0, "positions": 0, "write_pages": self.sink, "write_slots": 0, "context_len": 1}[name]
            h[i * smax + start:(i + 1) * smax] = value
        at = len(FIELDS) * smax
        knobs = h[at:at + len(KNOBS) * smax].view(np.float64).reshape(len(KNOBS), smax)
        knobs[:, start:] = np.array(GREEDY)[:, None]
        table = h[at + len(KNOBS) * smax:].reshape(smax, w)
        table[start:] = 0
        table[start:, 0] = self.sink

    def _write(self, rows: list[DecodeRow], S: int) -> None:
        """The step's integers into the host mirror (padding past len(rows) up to S), then one
        copy into the device buffers (CUDA; on CPU the mirror is the buffer)."""
        if self._copied is not None:
            self._copied.synchronize()      # the last copy out of the mirror is done (long since, normally)
        smax, B, h = self.buckets[-1], self.block_size, self._host_np
        n = len(rows)
        ctx = np.fromiter((r.context_len for r in rows), dtype=np.int64, count=n)
        pos = ctx - 1
        at = len(FIELDS) * smax
        knobs = h[at:at + len(KNOBS) * smax].view(np.float64).reshape(len(KNOBS), smax)
        knobs[:, :n] = np.array([(1.0,) + r.draw[0] if r.draw is not None else GREEDY for r in rows]).T
        table = h[at + len(KNOBS) * smax:].reshape(smax, self.width)
        table[:n] = 0
        write_pages = np.empty(n, dtype=np.int64)
        for j, r in enumerate(rows):
            k = -(-r.context_len // B)
            table[j, :k] = r.pages[:k]
            write_pages[j] = r.pages[(r.context_len - 1) // B]
        h[0:n] = [r.token for r in rows]
        h[smax:smax + n] = pos
        h[2 * smax:2 * smax + n] = write_pages
        h[3 * smax:3 * smax + n] = pos % B
        h[4 * smax:4 * smax + n] = ctx
        self._fill_padding(smax, n)
        if self._host is not self._dev:
            self._dev.copy_(self._host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    # ---- running ----------------------------------------------------------------------------
    def accepts(self, n: int, longest: int) -> bool:
        return 0 < n <= self.buckets[-1] and longest <= self.max_context

    @torch.inference_mode()
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step (valid until the next step); its token ids
        and NaN flags in `tokens` and `nan` ([len(rows)] each, on the device)."""
        n = len(rows)
        S = bucket_of(n, self.buckets)
        self._write(rows, S)
        self.steps += 1
        self.runs[S] = self.runs.get(S, 0) + 1
        drawn = [(j, r.draw[1]) for j, r in enumerate(rows) if r.draw is not None]
        for j, g in drawn:
            self._noise[j].exponential_(generator=g)   # the request's own stream, as the eager sampler draws it
        if drawn:
            self.drawn_steps += 1
        if self.mode == "cuda_graph":
            graph, (logits, tokens, nan) = self.graphs[S]
            graph.replay()
            if drawn:
                tail, tokens = self.tails[S]
                tail.replay()
        else:
            step, tail = (self._compiled, self._compiled_tail) if self.mode == "compile" else (self._step, self._tail)
            logits, tokens, nan = step(S)
            if drawn:
                tokens = tail(S, logits, tokens)
        self.tokens, self.nan = tokens[:n], nan[:n]
        return logits[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """cuda_graph: warm every bucket up, then capture it, largest first into one memory pool,
        with a progress line each. compile: compile every bucket now. static: nothing."""
        if self.mode == "static":
            return
        started = time.perf_counter()
        self._fill_padding(self.buckets[-1], 0)
        if self._host is not self._dev:
            self._dev.copy_(self._host)
        pool = None
        for i, S in enumerate(reversed(self.buckets), 1):
            t = time.perf_counter()
            if self.mode == "compile":
                logits, greedy, _ = self._compiled(S)
                self._compiled_tail(S, logits, greedy)
            else:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):           # warm-up: lazy inits, autotuning, allocator
                        self._step(S)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the loader's threads may use CUDA meanwhile; only this thread must not.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = self._step(S)
                pool = graph.pool()
                self.graphs[S] = (graph, out)
                # The draw over this bucket's logits: its own small graph, replayed after the step's.
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._tail(S, out[0], out[1])
                torch.cuda.current_stream(self.device).wait_stream(side)
                tail = torch.cuda.CUDAGraph()
                with torch.cuda.graph(tail, pool=pool, capture_error_mode="thread_local"):
                    tokens = self._tail(S, out[0], out[1])
                self.tails[S] = (tail, tokens)
            log.info("decode step: %s for batch %d (%d/%d) in %.1fs", "captured" if self.mode == "cuda_graph"
                     else "compiled", S, i, len(self.buckets), time.perf_counter() - t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("decode step: %d batch buckets %s ready in %.1fs (%s)", len(self.buckets), self.buckets,
                 time.perf_counter() - started, self.mode)
