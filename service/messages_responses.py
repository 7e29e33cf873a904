"""Response bodies of Anthropic's Messages API: a message, and a streamed message's events.

Knows: the message object (`{"id": "msg_...", "type": "message", "role": "assistant", "model",
"content": [{"type": "text", "text"}], "stop_reason", "stop_sequence", "usage"}`), how the
engine's ending maps to Anthropic's stop_reason ("length" -> "max_tokens"; a stop string ->
"stop_sequence" with the string; an end token -> "end_turn"), and the SSE events of a stream,
each with its `event:` line: message_start (the message with no content, and the prompt's usage),
content_block_start, ping, content_block_delta (text_delta), content_block_stop, message_delta
(stop_reason, stop_sequence, the whole usage: the client's accumulator takes its counts), message_stop,
and error (Anthropic's error body, for a stream that fails after it started).
Doesn't know: how the output was produced, or where the usage comes from (service/messages_usage.py).
"""
from __future__ import annotations

import json
from typing import Any

from service.errors import APIError
from service.messages_errors import anthropic_error


def stop_fields(finish_reason: str | None, stop_string: str | None) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` for the engine's finish_reason and matched stop string."""
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def message_body(message_id: str, model: str, text: str | None, stop: dict[str, Any] | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
    """A message: finished (`text` and `stop`), or a stream's opening (no content, no stop yet)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            **(stop or {"stop_reason": None, "stop_sequence": None}), "usage": usage}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its `event:` line (Anthropic's streams name every event)."""
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class MessageEvents:
    """The events of one streamed message, with its one text block (index 0)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model

    def start(self, usage: dict[str, Any]) -> bytes:
        return (event("message_start", {"type": "message_start",
                                         "message": message_body(self.id, self.model, None, None, usage)})
                + event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
                + event("ping", {"type": "ping"}))

    @staticmethod
    def text(text: str) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": text}})

    @staticmethod
    def stop(stop: dict[str, Any], usage: dict[str, Any]) -> bytes:
        return (event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
                + event("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error(err: APIError) -> bytes:
        return event("error", anthropic_error(err).body())
