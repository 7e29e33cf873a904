"""What a backend's answer must look like before the router passes it on: a verdict on bytes.

Knows: the shapes a tieredkv server (or any OpenAI-compatible one) answers with, checked loosely
enough for any such server and strictly enough that garbage cannot pass --
  - an error (any 4xx/5xx): a JSON object {"error": {"message": str, ...}};
  - a completion: {"object": "text_completion", "choices": [{"text": str}, ...]} (one choice
    at least); a chat completion: {"object": "chat.completion", "choices": [{"message":
    {"content": str | null}}, ...]}; /v1/models: {"data": [...]}; /v1/models/{id}: {"id": str};
  - a stream: `text/event-stream` of events, each `data: <JSON>` (or `data: [DONE]`, last; or
    comment lines), whose JSON is a chunk of the route's object ("text_completion" /
    "chat.completion.chunk" with a `choices` list whose entries carry `text` / a `delta`
    object) or an error event.
Each check returns None for a good answer, else a short reason (for last_error and the log).
`EventStream` cuts relayed bytes into whole events, so the proxy can hold the first event back
until it is checked (a retry is still possible then) and never pass a broken event on.
Doesn't know: HTTP, backends, or what is done with a verdict (proxy.py and relay.py decide).
"""
from __future__ import annotations

import json
from typing import Any

COMPLETION, CHAT, MODELS, MODEL, OTHER = "completion", "chat", "models", "model", "other"
MAX_SHOWN = 80          # bytes of a bad answer quoted in a reason


def kind_of(method: str, path: str) -> str:
    """Which shape the answer to `method path` must have."""
    if method == "POST" and path == "/v1/completions":
        return COMPLETION
    if method == "POST" and path == "/v1/chat/completions":
        return CHAT
    if path == "/v1/models":
        return MODELS
    if path.startswith("/v1/models/"):
        return MODEL
    return OTHER


def quoted(raw: bytes) -> str:
    """A few bytes of a bad answer, escaped, for a reason string."""
    return ascii(raw[:MAX_SHOWN]) + ("..." if len(raw) > MAX_SHOWN else "")


def json_object(raw: bytes) -> dict[str, Any] | None:
    """`raw` as a JSON object; None for anything else (invalid UTF-8, not JSON, nested past the
    parser's depth, an integer past the digit limit, not an object)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _is_error(doc: dict[str, Any]) -> bool:
    err = doc.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def check_error(raw: bytes) -> str | None:
    """An error status's body: OpenAI's error object."""
    doc = json_object(raw)
    if doc is None or not _is_error(doc):
        return f"an error answer that is not an OpenAI error object: {quoted(raw)}"
    return None


def check_body(kind: str, raw: bytes) -> str | None:
    """A 200's whole JSON body, for the route's kind."""
    doc = json_object(raw)
    if doc is None:
        return f"a 200 whose body is not a JSON object: {quoted(raw)}"
    if kind == OTHER:
        return None
    if kind == MODELS:
        ok = isinstance(doc.get("data"), list)
    elif kind == MODEL:
        ok = isinstance(doc.get("id"), str)
    else:
        choices = doc.get("choices")
        ok = doc.get("object") == ("chat.completion" if kind == CHAT else "text_completion") \
            and isinstance(choices, list) and bool(choices) and all(_choice_ok(kind, c, chunk=False) for c in choices)
    return None if ok else f"a 200 that is not a {kind} answer: {quoted(raw)}"


def _choice_ok(kind: str, c: Any, chunk: bool) -> bool:
    if not isinstance(c, dict):
        return False
    if kind == COMPLETION:
        return isinstance(c.get("text"), str)
    if chunk:
        return isinstance(c.get("delta"), dict)
    msg = c.get("message")
    return isinstance(msg, dict) and (msg.get("content") is None or isinstance(msg.get("content"), str))


def check_event(kind: str, event: bytes) -> tuple[str | None, bool]:
    """One whole SSE event (its lines, without the blank line ending it): (reason or None, done).
    `done` is True for `data: [DONE]`."""
    data: list[bytes] = []
    for line in event.split(b"\n"):
        line = line.removesuffix(b"\r")
        if line.startswith(b":") or not line:
            continue                   # a comment (a keep-alive)
        field, _, value = line.partition(b":")
        if field != b"data":
            if field in (b"event", b"id", b"retry"):
                continue
            return f"a stream line that is not an SSE field: {quoted(line)}", False
        data.append(value.removeprefix(b" "))
    if not data:
        return None, False             # comments only
    payload = b"\n".join(data)
    if payload == b"[DONE]":
        return None, True
    doc = json_object(payload)
    if doc is None:
        return f"a stream event that is not a JSON object: {quoted(payload)}", False
    if _is_error(doc):
        return None, False             # the backend's own error event: the client should see it
    choices = doc.get("choices")
    ok = doc.get("object") == ("chat.completion.chunk" if kind == CHAT else "text_completion") \
        and isinstance(choices, list) and all(_choice_ok(kind, c, chunk=True) for c in choices)
    return (None if ok else f"a stream event that is not a {kind} chunk: {quoted(payload)}"), False


class EventStream:
    """Bytes in, whole events out: `feed` returns the events completed by a chunk (each with
    its terminating blank line, as relayed). Events end at a blank line (\\n\\n or \\r\\n\\r\\n).
    NOTE: owned by one relay; not thread-safe."""

    def __init__(self, limit: int = 16 << 20) -> None:
        self._buf = b""
        self.limit = limit             # an event longer than this is garbage, not a reason to buffer more

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out = []
        while True:
            buf = self._buf.replace(b"\r\n", b"\n") if b"\r" in self._buf else self._buf
            end = buf.find(b"\n\n")
            if end < 0:
                self._buf = buf
                break
            out.append(buf[:end + 2])
            self._buf = buf[end + 2:]
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an event not finished yet."""
        return self._buf

    @property
    def overflowed(self) -> bool:
        return len(self._buf) > self.limit
