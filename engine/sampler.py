"""Picks the next token of every sequence in a step from its logits row, on the logits' device.

Knows: SamplingParams and a per-request torch.Generator on the model's device (seeded ->
reproducible on that device), and what makes sampling numerically safe for any valid params: a
temperature too small to matter is greedy (logits / 1e-38 overflow to inf and softmax turns them
into NaN), the arithmetic is done in float64 after subtracting the row's max, top-p always keeps
the top token, and a row with no usable probability mass falls back to argmax. A row with NaN
logits is the model's fault, not the request's params: SamplingError, which fails that request.

NOTE invariant (issue 9): nothing here waits for the device. Every row's choice, NaN flag and
logprobs stay on the device until `SampledStep.read()`, which copies them all back at once (one
packed transfer into pinned memory and one event wait per step, not one `.item()` per sequence).
Sampling is batched over rows (issue 30): temperature, min-p, top-k, top-p and logprobs are
tensor ops over every row that needs them, a few dozen kernels a step whatever its size; only
each sampled row's noise is its own kernel, drawn from its request's generator.
A draw is an exponential race (argmax of p / Exp(1) noise, a multinomial draw without the
host-side checks `torch.multinomial` makes): `race`, tensor ops only, which the graph-safe decode
step runs over all its rows in its graphs (engine/decode_graph.py, issue 42) -- a stage it runs for
a row that does not use it changes nothing, so the tokens are the ones drawn here.
Penalties (repetition, frequency, presence) and min_tokens' ban on end/stop ids change the logits
of the rows that ask for them, as tensor ops over those rows at once; a step where no row asks
does no such work and samples the model's logits as they are. Log-probabilities are always the
model's (before penalties and temperature), as vLLM reports them by default.
Doesn't know sequences or batching; the engine hands it the rows that produce a token (and, for
penalties and min_tokens, each row's prompt and output ids so far).
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from engine.sampling_params import SamplingParams

# Below this, temperature sampling is argmax up to float rounding: sample greedily.
MIN_TEMPERATURE = 1e-5


class SamplingError(RuntimeError):
    """No token can be chosen from this row (NaN logits)."""


def make_generator(params: SamplingParams, device: torch.device | str = "cpu",
                   choice: int = 0) -> torch.Generator | None:
    """The generator of one choice of a request (n > 1: choice 0..n-1; each its own stream)."""
    if is_greedy(params):
        return None
    g = torch.Generator(device=device)
    # Not torch.seed(): it reseeds the process's default generators (every CUDA device's too),
    # from a request thread, under every other request's feet.
    g.manual_seed(choice_seed(params.seed, choice) if params.seed is not None else secrets.randbits(63))
    return g


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded `seed`: choice 0 keeps the request's seed
    (n=1 is unchanged), the others a digest of (seed, choice): reproducible, and distinct."""
    if choice == 0:
        return seed
    digest = hashlib.sha256(f"tieredkv-choice:{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class RowResult:
    token: int
    nan: bool                                   # the row had NaN logits: SamplingError for its request
    top: list[tuple[int, float]] | None         # (token, logprob) of the top `logprobs`, when asked
    token_logprob: float | None                 # the chosen token's logprob, when asked


class SampledStep:
    """One step's choices, still on the device; `read()` brings them all back with one wait.

    Everything the host needs -- each row's token and NaN flag, and for the rows that asked, the
    chosen token's logprob and the top (index, logprob) pairs -- is packed into one float64 tensor
    (token ids are exact in float64), so a step is one device -> host copy."""

    def __init__(self, packed: torch.Tensor, widths: list[int], top_width: int) -> None:
        self._widths = widths                    # logprobs asked per row (0: none)
        self._top = top_width                    # the width of every asked row's top list
        if packed.is_cuda:
            # A pinned destination, so the copy is truly asynchronous and the one event wait below
            # is the step's only synchronisation.
            self._packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._packed.copy_(packed, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._packed, self._done = packed, None

    def read(self) -> list[RowResult]:
        if self._done is not None:
            self._done.synchronize()
        n, w = len(self._widths), self._top
        flat = self._packed.tolist()
        tokens, nans = flat[:n], flat[n:2 * n]
        asked = sum(1 for x in self._widths if x)
        chosen = flat[2 * n:2 * n + asked]
        idx_at, val_at = 2 * n + asked, 2 * n + asked + asked * w
        out, a = [], 0
        for i, width in enumerate(self._widths):
            if width:
                top = [(int(flat[idx_at + a * w + j]), flat[val_at + a * w + j]) for j in range(width)]
                out.append(RowResult(int(tokens[i]), bool(nans[i]), top, chosen[a]))
                a += 1
            else:
                out.append(RowResult(int(tokens[i]), bool(nans[i]), None, None))
        return out


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 history: Sequence[tuple[list[int], list[int]]] | None = None,
                 eos_ids: Collection[int] = ()) -> SampledStep:
    """logits [N, vocab] (any dtype, any device), one params and generator per row; `history`:
    each row's (prompt ids, output ids so far), needed only by rows with penalties or min_tokens;
    `eos_ids`: the ids min_tokens keeps from being sampled (besides the row's stop_token_ids).
    Every stage is one set of tensor ops over the rows it concerns; the only per-row kernel is
    each sampled row's noise, drawn from its own generator (so a seeded request draws exactly
    what it drew alone)."""
    nan = torch.isnan(logits).any(dim=-1)
    scores = _processed(logits, params, history, eos_ids)
    tokens = torch.argmax(scores, dim=-1)
    drawn = [i for i, (p, g) in enumerate(zip(params, generators)) if not is_greedy(p) and g is not None]
    if drawn:
        rows = upload([drawn], torch.long, scores.device)[0]
        choice = _draw([params[i] for i in drawn], [generators[i] for i in drawn], scores.index_select(0, rows))
        tokens = tokens.index_copy(0, rows, choice)
    return packed_step(tokens, nan, lambda: logits, [p.logprobs or 0 for p in params])


def packed_step(tokens: torch.Tensor, nan: torch.Tensor, logits: Callable[[], torch.Tensor],
                widths: list[int]) -> SampledStep:
    """A step's chosen `tokens` [N] and NaN flags [N] (device), and for the rows that ask
    (`widths`: logprobs per row, 0 none) their logprobs from the model's `logits()` [N, vocab]
    (asked for only then), packed for the step's one device -> host copy."""
    parts = [tokens.double(), nan.double()]
    top_width = max(widths)
    if top_width:
        asked = [i for i, w in enumerate(widths) if w]
        logits_ = logits()
        rows = upload([asked], torch.long, logits_.device)[0]
        lp = torch.log_softmax(logits_.index_select(0, rows).float(), dim=-1)     # the model's own
        top = lp.topk(top_width, dim=-1)                                          # [A, top_width]
        parts += [lp.gather(1, tokens.index_select(0, rows)[:, None]).view(-1).double(),
                  top.indices.reshape(-1).double(), top.values.reshape(-1).double()]
    return SampledStep(torch.cat(parts), widths, top_width)


def _banned(p: SamplingParams, output_len: int, eos_ids: Collection[int]) -> list[int]:
    """The ids min_tokens keeps this row from sampling now (none once it has min_tokens)."""
    if output_len >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))


def _processed(logits: torch.Tensor, params: list[SamplingParams],
               history: Sequence[tuple[list[int], list[int]]] | None, eos_ids: Collection[int]) -> torch.Tensor:
    """The logits with every row's penalties and min_tokens ban applied (float32), or `logits`
    itself when no row has any: the common step pays nothing."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if not penalized and not any(p.min_tokens for p in params):
        return logits
    if history is None:
        raise ValueError("sample_batch: penalties and min_tokens need each row's token history")
    bans = [(i, b) for i, p in enumerate(params) if p.min_tokens
            for b in [_banned(p, len(history[i][1]), eos_ids)] if b]
    if not penalized and not bans:
        return logits
    scores = logits.to(torch.float32, copy=True)
    vocab, device = scores.shape[-1], scores.device
    if penalized:
        ps = [params[i] for i in penalized]
        rows = upload([penalized], torch.long, device)[0]
        # float64: a repetition penalty as small or large as the params allow neither rounds to 0
        # nor turns a logit into NaN (an overflow is an infinity, as a logit may be).
        x = scores.index_select(0, rows).double()
        # [3, R]: repetition, frequency and presence penalty of each penalized row.
        rep, freq, pres = upload([[p.repetition_penalty for p in ps], [p.frequency_penalty for p in ps],
                                   [p.presence_penalty for p in ps]], torch.float64, device).unsqueeze(2)
        counts = _counts([history[i][1] for i in penalized], vocab, device)      # output tokens only
        present = counts > 0
        if any(p.repetition_penalty != 1 for p in ps):
            prompts = [history[i][0] if p.repetition_penalty != 1 else [] for i, p in zip(penalized, ps)]
            seen = present | (_counts(prompts, vocab, device) > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * present
        scores.index_copy_(0, rows, x.float())
    if bans:
        pairs = [(i, t) for i, ids in bans for t in ids if t < vocab]
        if pairs:
            where = upload([[i for i, _ in pairs], [t for _, t in pairs]], torch.long, device)
            scores[where[0], where[1]] = float("-inf")
    return scores


def _counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] float64: how often each token id occurs in each list."""
    width = max((len(ids) for ids in lists), default=0)
    out = torch.zeros((len(lists), vocab + 1), dtype=torch.float64, device=device)
    if width:
        # Padded with `vocab`, a column cut off below (so is any id past the logits' width).
        idx = upload([ids + [vocab] * (width - len(ids)) for ids in lists], torch.long, device).clamp_(0, vocab)
        out.scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.float64, device=device))
    return out[:, :vocab]


def upload(rows: list[list], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list of rows as a device tensor, without waiting for the device (pinned memory and a
    non-blocking copy under CUDA: the step's invariant is one wait, in SampledStep.read)."""
    t = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _draw(params: list[SamplingParams], generators: list[torch.Generator], rows: torch.Tensor) -> torch.Tensor:
    """[R] device tensor: each row's token drawn from temperature + min-p + top-k + top-p over
    its scores `rows` [R, vocab], as tensor ops over all R rows at once (float64)."""
    R, vocab = rows.shape
    device = rows.device
    # [4, R]: temperature, min_p, top-k (0: off), top-p.
    knobs = upload([draw_knobs(p, vocab) for p in params], torch.float64, device).T
    noise = torch.empty((R, vocab), dtype=torch.float64, device=device)
    for j, g in enumerate(generators):
        noise[j].exponential_(generator=g)        # each request's own stream, as when drawn alone
    ks = [p.top_k for p in params if 0 < p.top_k < vocab]
    return race(rows, knobs, noise, min_p=any(p.min_p > 0 for p in params), top_k=max(ks, default=0),
                top_p=any(p.top_p < 1.0 for p in params))


def draw_knobs(p: SamplingParams, vocab: int) -> tuple[float, float, float, float]:
    """One row's (temperature, min_p, top-k (0: off), top-p), as `race` reads them."""
    return (p.temperature, p.min_p, p.top_k if 0 < p.top_k < vocab else 0, p.top_p)


def race(rows: torch.Tensor, knobs: torch.Tensor, noise: torch.Tensor, *, min_p: bool = True, top_k: int = -1,
         top_p: bool = True) -> torch.Tensor:
    """[R] tokens drawn from `rows` [R, vocab] with `knobs` [4, R] float64 (draw_knobs' columns)
    and `noise` [R, vocab] float64 Exp(1) draws, in tensor ops only: no host sync, shapes fixed by
    the inputs (so a graph can hold it: engine/decode_graph.py). The keywords skip a stage no row
    uses (min_p 0, top-k off, top-p 1 change nothing in it) and `top_k` is the widest k of any row
    (-1: the whole row); a stage run for every row gives every row the same token as skipping it."""
    vocab = rows.shape[-1]
    temperature, min_p_, top_p_ = knobs[0, :, None], knobs[1, :, None], knobs[3, :, None]
    x = rows.double()
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature   # finite: the max is 0, the rest <= 0 or -inf
    if min_p:
        # vLLM's order: min_p on the tempered distribution, then top-k and top-p. The top token
        # always stays (its probability is the max); min_p 0 drops nothing.
        p = torch.softmax(x, dim=-1)
        x = x.masked_fill(p < min_p_ * p.amax(dim=-1, keepdim=True), float("-inf"))
    if top_k:
        k = knobs[2].long()[:, None]
        # The k-th largest value of each row (its last kept); a row without top-k cuts nothing.
        values = torch.topk(x, vocab if top_k < 0 else top_k, dim=-1).values
        kth = torch.where(k > 0, values.gather(1, (k - 1).clamp(min=0)), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. NOTE: the top token is always kept:
        # its preceding mass is exactly 0.0 (cum[0] - sorted_p[0]) and top_p > 0, however small.
        # A row with top_p 1 keeps everything (its cut is off, not "mass >= 1", which rounding
        # could reach before the last tokens).
        drop = (cum - sorted_p >= top_p_) & (top_p_ < 1.0)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    drawn = torch.argmax(probs / noise, dim=-1)
    total = probs.sum(dim=-1)
    # No mass left (or NaN): the top token. Chosen on the device, so no host check is needed.
    return torch.where(total > 0, drawn, torch.argmax(x, dim=-1))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row (tests and tools): the token id; raises SamplingError on NaN."""
    row = sample_batch(logits.unsqueeze(0), [params], [generator]).read()[0]
    if row.nan:
        raise SamplingError("the model produced NaN logits for this request")
    return row.token
