"""Picks the next token from a row of logits: greedy, or temperature + top-k + top-p.

Knows: SamplingParams and a per-request torch.Generator (seeded -> reproducible). Doesn't know
sequences or batching; the scheduler hands it one logits row per sequence that produces a token.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] (any dtype/device). Returns one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = cum - sorted_p >= params.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
