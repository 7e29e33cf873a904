"""Response bodies in OpenAI's shapes, and Server-Sent Events framing.

Knows: the JSON of a completion, a chat completion, their stream chunks, and the usage
object -- OpenAI's fields, DeepSeek's cache fields, and the per-tier split:
  prompt_tokens, completion_tokens, total_tokens,
  prompt_cache_hit_tokens, prompt_cache_miss_tokens            (DeepSeek)
  prompt_tokens_details: {cached_tokens}                       (OpenAI)
  prompt_cache_hit_tokens_by_tier: {device, host, disk}        (tieredkv)
Doesn't know: how the output was produced, tenants, or HTTP statuses.
"""
from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


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
        "prompt_cache_hit_tokens_by_tier": {t: usage.hit_tokens_by_tier.get(t, 0) for t in ("device", "host", "disk")},
    }


def completion_id(request_id: str, chat: bool) -> str:
    """OpenAI-style id from the engine's request id ("cmpl-<hex>"): "cmpl-<hex>" / "chatcmpl-<hex>".
    The x-request-id header carries the engine's id as it is (the ledger's key)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id.removeprefix('cmpl-')}"


def completion_body(out: Any, model: str, created: int) -> dict[str, Any]:
    return {
        "id": completion_id(out.request_id, chat=False),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}],
        "usage": usage_dict(out.usage),
    }


def chat_body(out: Any, model: str, created: int) -> dict[str, Any]:
    return {
        "id": completion_id(out.request_id, chat=True),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": None, "finish_reason": out.finish_reason}],
        "usage": usage_dict(out.usage),
    }


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

    def role(self) -> bytes:
        """Chat streams open with the assistant's role and no content."""
        return sse(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]))

    def text(self, text: str, finish_reason: str | None = None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return sse(self._chunk([choice]))

    def usage(self, usage: Any) -> bytes:
        body = self._chunk([])
        body["usage"] = usage_dict(usage)
        return sse(body)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
