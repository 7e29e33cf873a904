"""The `prompt` field of a request body: one prompt, or (on /v1/completions) a batch of them.

Knows: OpenAI's four shapes -- a string, a list of token ids, a list of strings, a list of
token-id lists (vLLM accepts the same) -- and which of them a field takes: one prompt only
(`check_prompt`: the cache routes, which answer for one prompt), or a batch too
(`check_prompts`: /v1/completions, one choice per prompt and choice). A list of ints is always
one prompt of token ids; a batch is not empty, holds one kind of prompt (strings, or token
lists), and at most MAX_BATCH_PROMPTS of them.
Doesn't know: the tokenizer, the context's size, or how a batch is run (service/batch_prompts.py).
"""
from __future__ import annotations

from typing import Any

# Prompts one /v1/completions body may batch (OpenAI's documented bound on a prompt array).
MAX_BATCH_PROMPTS = 2048

OnePrompt = str | list[int]
Prompts = OnePrompt | list[str] | list[list[int]]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def check_prompt(v: Any) -> OnePrompt:
    """One prompt: a string or a list of token ids (ValueError otherwise, naming a batch's refusal)."""
    if isinstance(v, str) or _is_ids(v):
        return v
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise ValueError("a batch of prompts is not taken here; send one prompt (a string or a list of token ids)")
    raise ValueError("expected a string or a list of integer token ids")


def check_prompts(v: Any) -> Prompts:
    """One prompt, or a batch: a non-empty list of strings, or of token-id lists."""
    if isinstance(v, str) or _is_ids(v):
        return v
    if isinstance(v, list) and all(isinstance(p, str) for p in v):
        kind = "strings"
    elif isinstance(v, list) and all(_is_ids(p) for p in v):
        kind = "token lists"
    else:
        raise ValueError("expected a string, a list of integer token ids, a list of strings, "
                         "or a list of lists of integer token ids")
    if len(v) > MAX_BATCH_PROMPTS:
        raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request, got {len(v)} {kind}")
    return v

