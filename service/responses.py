"""Response bodies in OpenAI's shapes, and Server-Sent Events framing.

Knows: the JSON of a completion, a chat completion, their stream chunks, and the usage
object -- OpenAI's fields, DeepSeek's cache fields, and the per-tier split:
  prompt_tokens, completion_tokens, total_tokens,
  prompt_cache_hit_tokens, prompt_cache_miss_tokens            (DeepSeek)
  prompt_tokens_details: {cached_tokens}                       (OpenAI)
  prompt_cache_hit_tokens_by_tier: {device, host, disk, remote}  (tieredkv)
and the `logprobs` object of a choice, in completions' and chat's shapes.
Doesn't know: how the output was produced, tenants, or HTTP statuses.
"""
from __future__ import annotations

import json
from typing import Any

from engine.outputs import TIERS

SSE_DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0    # -inf and NaN are not JSON: lower log-probabilities are sent as this (as vLLM's)


def usage_dict(usage: Any) -> dict[str, Any]:
    """engine.outputs.Usage -> the usage object every response carries."""
    hit = usage.prompt_cache_hit_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_cache_hit_tokens": hit,
        "prompt_cache_miss_tokens": usage.prompt_cache_miss_tokens,
        "prompt_tokens_details": {"cached_tokens": hit},
        "prompt_cache_hit_tokens_by_tier": {t: usage.hit_tokens_by_tier.get(t, 0) for t in TIERS},
        **retention_fields(usage),
    }


def retention_fields(usage: Any) -> dict[str, Any]:
    """A retaining request's cache writes by class, token-seconds bought and tokens refused (issue
    39); nothing for any other request (the usage of a request that asked no retention is OpenAI's)."""
    written = getattr(usage, "cache_write_tokens", None) or {}
    seconds = getattr(usage, "retained_token_seconds", 0)
    refused = getattr(usage, "retention_refused_tokens", 0)
    if not (written or seconds or refused):
        return {}
    return {"cache_write_tokens": dict(written), "retained_token_seconds": seconds, "retention_refused_tokens": refused}


def completion_id(request_id: str, chat: bool) -> str:
    """OpenAI-style id from the engine's request id ("cmpl-<hex>", or "chatcmpl-<hex>" where the
    chat route asked the engine for it): "cmpl-<hex>" / "chatcmpl-<hex>"."""
    hexpart = request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
    return f"{'chatcmpl' if chat else 'cmpl'}-{hexpart}"


def completion_body(outs: Any, model: str, created: int, logprobs: Any = None) -> dict[str, Any]:
    """One output, or a request's n choices (a list, index order, each carrying the request's
    usage); `logprobs`: the logprobs object of each (or of the one)."""
    outs, lps = _choices(outs, logprobs)
    return {
        "id": completion_id(outs[0].request_id, chat=False),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": o.index, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason}
                    for o, lp in zip(outs, lps)],
        "usage": usage_dict(outs[0].usage),
    }


def chat_body(outs: Any, model: str, created: int, logprobs: Any = None) -> dict[str, Any]:
    outs, lps = _choices(outs, logprobs)
    return {
        "id": completion_id(outs[0].request_id, chat=True),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                     "logprobs": lp, "finish_reason": o.finish_reason} for o, lp in zip(outs, lps)],
        "usage": usage_dict(outs[0].usage),
    }


def _choices(outs: Any, logprobs: Any) -> tuple[list, list]:
    if isinstance(outs, list):
        return outs, list(logprobs) if logprobs is not None else [None] * len(outs)
    return [outs], [logprobs]


class Logprobs:
    """One response's `logprobs` objects, from the engine's per-token log-probabilities (a
    CompletionOutput's or a StreamChunk's `token_ids`, `logprobs` (top n) and `token_logprobs`).

    Completions: {tokens, token_logprobs, top_logprobs, text_offset}; each top_logprobs dict
    holds the n most likely tokens and the sampled one (up to n + 1 entries, as OpenAI's), and
    text_offset runs on across a stream's chunks. Chat: {content: [{token, logprob, bytes,
    top_logprobs: [n x {token, logprob, bytes}]}], refusal: null}. A token's text is its own
    decoding, as vLLM's: a token holding part of a multi-byte character reads as U+FFFD.
    """

    def __init__(self, tokenizer: Any, n: int, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.n = n
        self.chat = chat
        self.text_offset = 0

    def fresh(self) -> "Logprobs":
        """The same settings with its own text offsets (another choice of the same response)."""
        return Logprobs(self.tokenizer, self.n, self.chat)

    def _names(self, ids: set[int]) -> dict[int, str]:
        order = sorted(ids)
        if self.tokenizer is None:
            return {i: f"token_id:{i}" for i in order}
        return dict(zip(order, self.tokenizer.batch_decode([[i] for i in order])))

    def of(self, out: Any) -> dict[str, Any] | None:
        """The object for `out`'s tokens; None when it has none (or logprobs were not asked)."""
        if not out.token_ids or out.token_logprobs is None:
            return None
        tops = [step[:self.n] for step in out.logprobs]
        name = self._names({i for step in tops for i, _ in step} | set(out.token_ids))
        if self.chat:
            def entry(i: int, lp: float) -> dict[str, Any]:
                return {"token": name[i], "logprob": _finite(lp), "bytes": list(name[i].encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in top]}
                                for t, lp, top in zip(out.token_ids, out.token_logprobs, tops)],
                    "refusal": None}
        offsets = []
        for t in out.token_ids:
            offsets.append(self.text_offset)
            self.text_offset += len(name[t])
        top_dicts = []
        for t, lp, top in zip(out.token_ids, out.token_logprobs, tops):
            d: dict[str, float] = {}
            for i, x in [*top, (t, lp)]:          # the likeliest wins a name clash
                d.setdefault(name[i], _finite(x))
            top_dicts.append(d)
        return {"tokens": [name[t] for t in out.token_ids], "token_logprobs": [_finite(lp) for lp in out.token_logprobs],
                "top_logprobs": top_dicts, "text_offset": offsets}


def _finite(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR       # NaN too


class ChunkWriter:
    """The SSE events of one streamed response, completion or chat.

    With include_usage, every chunk carries "usage": null and one last chunk carries the
    usage with `choices: []`, as OpenAI's do.
    """

    def __init__(self, request_id: str, model: str, created: int, chat: bool, include_usage: bool) -> None:
        self.id = completion_id(request_id, chat)
        self.model = model
        self.created = created
        self.chat = chat
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def role(self, index: int = 0) -> bytes:
        """Chat streams open (each choice's) with the assistant's role and no content."""
        return sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]))

    def text(self, text: str, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
             index: int = 0) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(self._chunk([choice]))

    def usage(self, usage: Any) -> bytes:
        body = self._chunk([])
        body["usage"] = usage_dict(usage)
        return sse(body)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
