"""A request's ask to keep its prompt's prefix (issue 39): spans of the prompt, each under a
retention class, turned into the cache's retention at submit and into usage at the end.

Knows:
- `RetainSpan(tokens, klass)`: the prompt's first `tokens` tokens (None: the whole prompt) kept
  under `klass` ("5m", "1h", "24h"). Spans come in prompt order, each covering from where the one
  before it ended (Anthropic's cache_control breakpoints, each with its own ttl; OpenAI's
  prompt_cache_retention "24h" is one span over the whole prompt).
- At submit (`retain_request`, the caller's thread): the full blocks each span covers, retained
  for the tenant (TieredKVCache.retain); a block refused by a bound refuses the rest of the chain.
  Retained before the blocks exist is fine: they are kept from the moment they are computed.
- At the end (`retention_usage`): the tokens written under each class (a span's tokens that were
  not read from the cache and were not refused: Anthropic's cache_creation, what is billed as a
  write), the token-seconds bought (each block's deadline moved on, times block_size), and the
  tokens refused (served and cached as ever, only not kept past LRU).
Doesn't know: HTTP (the routes build spans from their fields), billing prices, or how the cache
keeps blocks (storage/cache_retention.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from engine.outputs import RETENTION_CLASSES

__all__ = ["RetainRecord", "RetainSpan", "check_spans", "retain_request", "retention_usage"]


@dataclass(frozen=True)
class RetainSpan:
    tokens: int | None       # the prompt's first `tokens` tokens (None: the whole prompt)
    klass: str               # "5m", "1h" or "24h"


@dataclass
class RetainRecord:
    """What a request's spans bought, kept on its Sequence from submit to its bill."""
    ends: list[tuple[int, str]] = field(default_factory=list)   # each span's end (tokens) and class
    refused_from: int | None = None       # the token where the cache refused the rest (a block start)
    block_seconds: float = 0.0


def check_spans(spans: Seq[RetainSpan]) -> tuple[RetainSpan, ...]:
    """Spans validated (ValueError naming the field)."""
    out = tuple(spans)
    last = 0
    for s in out:
        if not isinstance(s, RetainSpan):
            raise ValueError(f"retain: expected RetainSpan items, got {s!r}")
        if s.klass not in RETENTION_CLASSES:
            raise ValueError(f"retain: retention class must be one of {RETENTION_CLASSES}, got {s.klass!r}")
        if s.tokens is not None:
            if isinstance(s.tokens, bool) or not isinstance(s.tokens, int) or s.tokens < last:
                raise ValueError(f"retain: span ends must be ints in prompt order, got {s.tokens!r} after {last}")
            last = s.tokens
    return out


def retain_request(cache, tenant: str, keys: Seq, prompt_tokens: int, block_size: int,
                   spans: Seq[RetainSpan]) -> RetainRecord | None:
    """Retain the full blocks `spans` cover (`keys`: the prompt's block chain) for `tenant`."""
    if not spans:
        return None
    rec = RetainRecord()
    done_blocks = 0
    for s in spans:
        end = prompt_tokens if s.tokens is None else min(s.tokens, prompt_tokens)
        rec.ends.append((end, s.klass))
        upto = min(end // block_size, len(keys))
        if upto <= done_blocks:
            continue
        if rec.refused_from is not None:
            continue
        outcome = cache.retain(tenant, list(keys[done_blocks:upto]), s.klass)
        rec.block_seconds += outcome.block_seconds
        if outcome.refused:
            rec.refused_from = (done_blocks + outcome.retained) * block_size
        done_blocks = upto
    return rec


def retention_usage(rec: RetainRecord | None, prompt_tokens: int, read_tokens: int,
                    block_size: int) -> tuple[dict[str, int], int, int]:
    """(tokens written by class, token-seconds bought, tokens refused) for a request that read
    its first `read_tokens` prompt tokens from the cache."""
    if rec is None:
        return {}, 0, 0
    bought = int(round(rec.block_seconds * block_size))
    if prompt_tokens == 0:       # never admitted (its caller left): nothing written, what it bought stays bought
        return {}, bought, 0
    written: dict[str, int] = {}
    refused = 0
    start = 0
    cut = prompt_tokens if rec.refused_from is None else rec.refused_from
    for end, klass in rec.ends:
        end = min(end, prompt_tokens)
        lo = max(start, read_tokens)
        n = max(0, min(end, cut) - lo)
        if n:
            written[klass] = written.get(klass, 0) + n
        refused += max(0, end - max(lo, cut))
        start = max(start, end)
    return written, bought, refused
