"""One log line per request the router answers, on the logger `tieredkv.router.requests`.

Knows: what a line says, in the server's format (service/request_log.py) plus the backend:
`id=cmpl-... tenant=acme POST /v1/completions 200 backend=http://b1:8000 prompt_tokens=48
time_ms=12.5`. The id is the one the backend made (its answer's x-request-id: the same id its
own line and the client's body carry), else the client's X-Request-Id; the tenant is the one the
backend named when the router asked it for the prompt's block hashes (the router derives none
itself: "-" when it did not ask, or the asking failed); the backend is the one that answered
(the answer's X-Tieredkv-Backend), "-" when none did; `cache_key=` the body's prompt_cache_key,
only when it has one. A stream's line is written after its last
chunk. uvicorn's own access line is off (service/router/server.py): this one replaces it.
Levels as a server's: INFO, WARNING for a 5xx, DEBUG for a successful probe (/health, /metrics)
unless `log_probes` (`route --log-probes`).
Doesn't know: routes, or how a backend is chosen.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from service.http_middleware import HTTPMiddleware, StatusSend
from service.request_log import fields_of, format_line, is_polling, scope_record, shown

log = logging.getLogger("tieredkv.router.requests")

_STATE_KEY = "tieredkv_router_prompt_tokens"


def note_prompt(scope: Scope, tenant: str | None, prompt_tokens: int | None) -> None:
    """What the backend's block-hash answer said about this request: its tenant, its prompt's length."""
    scope_record(scope).tenant = tenant
    scope.setdefault("state", {})[_STATE_KEY] = prompt_tokens


class _AnswerSend(StatusSend):
    """StatusSend that also keeps the answer's request id and backend headers."""

    def __init__(self, send: Send) -> None:
        super().__init__(send)
        self.request_id: str | None = None
        self.backend: str | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            for k, v in message.get("headers") or ():
                if k.lower() == b"x-request-id":
                    self.request_id = v.decode("latin-1")
                elif k.lower() == b"x-tieredkv-backend":
                    self.backend = v.decode("latin-1")
        await super().__call__(message)


def line_fields(scope: Scope, sent: _AnswerSend, elapsed_s: float) -> dict[str, Any]:
    """The line's fields: the server's, with the backend after the status, and the prompt's tokens."""
    rec = scope_record(scope)
    headers = dict(scope.get("headers") or ())
    client_id = headers.get(b"x-request-id")
    answer_id = sent.request_id or (client_id.decode("latin-1") if client_id else None)
    base = fields_of(scope.get("method", "?"), scope.get("path", "?"), sent.status, rec, answer_id, elapsed_s)
    fields: dict[str, Any] = {}
    for key, value in base.items():
        fields[key] = value
        if key == "status":
            fields["backend"] = shown(sent.backend) if sent.backend else "-"
            prompt_tokens = scope.get("state", {}).get(_STATE_KEY)
            if prompt_tokens is not None:
                fields["prompt_tokens"] = prompt_tokens
    return fields


class RouterRequestLog(HTTPMiddleware):
    """ASGI middleware, outermost: the line for every HTTP request, once its answer has been sent."""

    def __init__(self, app: Any, log_probes: bool = False) -> None:
        super().__init__(app)
        self.log_probes = log_probes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        sent = _AnswerSend(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            quiet = (not self.log_probes and sent.status < 400
                     and is_polling(scope.get("path", ""), dict(scope.get("headers") or ())))
            level = logging.WARNING if sent.status >= 500 else logging.DEBUG if quiet else logging.INFO
            if log.isEnabledFor(level):
                fields = line_fields(scope, sent, time.perf_counter() - started)
                log.log(level, "%s", format_line(fields), extra={"request_fields": fields})
