"""A batch of prompts on /v1/completions as one response: OpenAI's and vLLM's shape.

Knows: how the engine's per-prompt outputs (each its own request, billed on its own: one
output, or the list of its n choices) become one response's choices -- indexed prompt-major,
index = prompt_index * n + choice, as OpenAI and vLLM number them -- and the response's usage:
every prompt's usage summed (prompt tokens, completion tokens, hits by tier, misses), the sum
of what the ledger billed each prompt. A streamed batch's usage is summed the same way from
each prompt's last chunk (`UsageByRequest`).
Doesn't know: HTTP, the engine's scheduling, or response JSON (service/responses.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from engine.outputs import RETENTION_CLASSES, TIERS, Usage


def sum_usage(usages: Iterable[Usage]) -> Usage:
    usages = list(usages)
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 hit_tokens_by_tier={t: sum(u.hit_tokens_by_tier.get(t, 0) for u in usages) for t in TIERS},
                 prompt_cache_miss_tokens=sum(u.prompt_cache_miss_tokens for u in usages),
                 cache_write_tokens={c: n for c in RETENTION_CLASSES
                                     if (n := sum(u.cache_write_tokens.get(c, 0) for u in usages))},
                 retained_token_seconds=sum(u.retained_token_seconds for u in usages),
                 retention_refused_tokens=sum(u.retention_refused_tokens for u in usages))


def flatten(outs: list[Any], n: int) -> list[Any]:
    """The engine's outputs of a batch (one per prompt: an output, or its n choices) as one list
    of choices, index = prompt_index * n + choice, each carrying the batch's summed usage."""
    per_prompt = [o if isinstance(o, list) else [o] for o in outs]
    usage = sum_usage(choices[0].usage for choices in per_prompt)
    return [dataclasses.replace(o, index=i * n + o.index, usage=usage)
            for i, choices in enumerate(per_prompt) for o in choices]


def as_one(choices: list[Any]) -> Any:
    """A batch's flattened choices as the one output a log line and the metrics count: the first
    choice, with the batch's usage, finish_reason "abort" when any choice was aborted."""
    aborted = any(o.finish_reason == "abort" for o in choices)
    return dataclasses.replace(choices[0], finish_reason="abort") if aborted else choices[0]


class UsageByRequest:
    """A streamed batch's usage: each prompt's (its request's) usage from its last chunks, summed
    once every prompt has reported. Event loop only (the stream's body)."""

    def __init__(self) -> None:
        self._by_request: dict[str, Usage] = {}

    def add(self, chunk: Any) -> None:
        if chunk.usage is not None:
            self._by_request[chunk.request_id] = chunk.usage

    def total(self) -> Usage | None:
        return sum_usage(self._by_request.values()) if self._by_request else None
