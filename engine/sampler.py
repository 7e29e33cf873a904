"""Picks the next token from a row of logits: greedy, or temperature + top-k + top-p.

Knows: SamplingParams and a per-request torch.Generator (seeded -> reproducible), and what makes
sampling numerically safe for any valid params: a temperature too small to matter is greedy
(logits / 1e-38 overflow to inf and softmax turns them into NaN), the arithmetic is done in
float64 after subtracting the row's max, top-p always keeps the top token, and a row with no
usable probability mass falls back to argmax. A row with NaN logits is the model's fault, not
the request's params: SamplingError, which fails that one request.
Doesn't know sequences or batching; the engine hands it one logits row per sequence that
produces a token.
"""
from __future__ import annotations

import secrets

import torch

from engine.sampling_params import SamplingParams

# Below this, temperature sampling is argmax up to float rounding: sample greedily.
MIN_TEMPERATURE = 1e-5


class SamplingError(RuntimeError):
    """No token can be chosen from this row (NaN logits)."""


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if is_greedy(params):
        return None
    g = torch.Generator()
    # Not torch.seed(): it reseeds the process's default generators (every CUDA device's too),
    # from a request thread, under every other request's feet.
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] (any dtype/device). Returns one token id; raises SamplingError on NaN."""
    if torch.isnan(logits).any():
        raise SamplingError("the model produced NaN logits for this request")
    if is_greedy(params) or generator is None:
        return int(torch.argmax(logits))
    x = logits.double().cpu()
    x = (x - x.max()) / params.temperature          # finite: the max is 0, the rest <= 0 or -inf
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. NOTE: the top token is always kept
        # (its preceding mass is 0 < top_p), however small top_p is.
        drop = cum - sorted_p >= params.top_p
        drop[0] = False
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    total = float(probs.sum())
    if not total > 0 or total != total:              # no mass left (or NaN): the top token
        return int(torch.argmax(x))
    return int(torch.multinomial(probs, 1, generator=generator))
