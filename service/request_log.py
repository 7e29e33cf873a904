"""One log line per HTTP request, on the logger `tieredkv.requests`.

Knows: what a line says -- request id, tenant, method and path, status, prompt and completion
tokens, hit tokens by tier, TTFT, the whole request's time, the prompt_cache_key when given, and for an error the reason the
client was given -- and where the parts come from: the routes and the error handlers note them
on the request (`record(request)`, kept in the ASGI scope's state), and `RequestLog`, the
outermost middleware, writes the line once the response is sent (a stream: after its last
chunk). Every line also carries its fields as the log record's `request_fields` (a dict), for
structured handlers.
Levels: INFO, WARNING for a 5xx. Polling is DEBUG when it succeeds, so it does not bury the
traffic: probes (/health, /ready, /metrics), the router's own calls (/v1/cache/block_hashes, asked
once per routed request) and the dashboard: its page and files (/dashboard, /dashboard/*) and
its fetches (they say `X-Tieredkv-Client: dashboard`), so a dashboard left open logs nothing.
`RequestLog(log_probes=True)` (`serve --log-probes`) writes them at INFO too.
Doesn't know: routes, the engine, or how errors are shaped.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.types import Receive, Scope, Send

from engine.outputs import TIERS
from service.http_middleware import HTTPMiddleware, StatusSend

log = logging.getLogger("tieredkv.requests")

_STATE_KEY = "tieredkv_request"
PROBES = frozenset({"/health", "/ready", "/metrics"})
# Paths only machines poll: load balancers and Prometheus (PROBES), the router (block hashes).
QUIET_PATHS = PROBES | {"/v1/cache/block_hashes"}
DASHBOARD = "/dashboard"                      # the page and its files (/dashboard/dashboard.js, ...)
CLIENT_HEADER = b"x-tieredkv-client"          # the dashboard's fetches send "dashboard"
QUIET_CLIENTS = frozenset({b"dashboard"})
_MAX_SHOWN = 200        # characters of a client-chosen string (path, request id, tenant) in a line


@dataclass
class RequestRecord:
    """What the routes learned about one request; None: not known (not a generation, or failed first)."""
    request_id: str | None = None
    tenant: str | None = None
    usage: Any = None                  # engine.outputs.Usage
    ttft_s: float | None = None
    reason: str | None = None          # an error's message, as the client got it
    cache_key: str | None = None       # the body's prompt_cache_key, when given

    def finished(self, request_id: str, usage: Any, metrics: Any) -> None:
        self.request_id = request_id
        self.usage = usage
        self.ttft_s = getattr(metrics, "ttft_s", None)


def scope_record(scope: Scope) -> RequestRecord:
    """The record of the request whose ASGI scope this is (made on first use)."""
    state = scope.setdefault("state", {})
    rec = state.get(_STATE_KEY)
    if rec is None:
        rec = state[_STATE_KEY] = RequestRecord()
    return rec


def record(request: Request) -> RequestRecord:
    """This request's record (made on first use)."""
    return scope_record(request.scope)


def shown(text: str, limit: int = _MAX_SHOWN) -> str:
    """A client-chosen string made safe for one log line: control characters escaped, cut short."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return json.dumps(text, ensure_ascii=False)[1:-1]


def fields_of(method: str, path: str, status: int, rec: RequestRecord, header_id: str | None,
              elapsed_s: float) -> dict[str, Any]:
    """The line's fields, in order; those not known for this request are left out."""
    fields: dict[str, Any] = {"id": rec.request_id or (shown(header_id) if header_id else "-"),
                              "tenant": shown(rec.tenant) if rec.tenant is not None else "-",
                              "method": method, "path": shown(path), "status": status}
    if rec.usage is not None:
        fields["prompt_tokens"] = rec.usage.prompt_tokens
        fields["completion_tokens"] = rec.usage.completion_tokens
        fields["hit_tokens"] = {t: rec.usage.hit_tokens_by_tier.get(t, 0) for t in TIERS}
    if rec.ttft_s is not None:
        fields["ttft_ms"] = round(rec.ttft_s * 1e3, 1)
    fields["time_ms"] = round(elapsed_s * 1e3, 1)
    if rec.cache_key is not None:
        fields["cache_key"] = shown(rec.cache_key)
    if status >= 400 or rec.reason is not None:
        fields["reason"] = rec.reason          # None: the error came from nowhere that said why
    return fields


def format_line(fields: dict[str, Any]) -> str:
    """`id=cmpl-... tenant=alice POST /v1/completions 200 prompt_tokens=48 ... reason="..."`."""
    parts = [f"id={fields['id']}", f"tenant={fields['tenant']}", fields["method"], fields["path"], str(fields["status"])]
    for key, value in fields.items():
        if key in ("id", "tenant", "method", "path", "status"):
            continue
        if key == "hit_tokens":
            value = ",".join(f"{t}:{n}" for t, n in value.items())
        elif key == "reason":
            value = "-" if value is None else f'"{shown(value, 1000)}"'
        parts.append(f"{key}={value}")
    return " ".join(parts)


def is_polling(path: str, headers: dict[bytes, bytes]) -> bool:
    """A machine's polling: a probe, the router's own call, the dashboard (its page, its files, its
    refreshing fetches)."""
    return (path in QUIET_PATHS or path == DASHBOARD or path.startswith(DASHBOARD + "/")
            or headers.get(CLIENT_HEADER, b"").lower() in QUIET_CLIENTS)


class RequestLog(HTTPMiddleware):
    """ASGI middleware: the line for every HTTP request, written once its response has been sent.
    `log_probes`: polling's successful answers at INFO too (else DEBUG)."""

    def __init__(self, app: Any, log_probes: bool = False) -> None:
        super().__init__(app)
        self.log_probes = log_probes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        sent = StatusSend(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            rec = scope_record(scope)
            headers = dict(scope.get("headers") or ())
            header_id = headers.get(b"x-request-id")
            fields = fields_of(scope.get("method", "?"), scope.get("path", "?"), sent.status, rec,
                               header_id.decode("latin-1") if header_id else None, time.perf_counter() - started)
            quiet = not self.log_probes and sent.status < 400 and is_polling(scope.get("path", ""), headers)
            level = logging.WARNING if sent.status >= 500 else logging.DEBUG if quiet else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s", format_line(fields), extra={"request_fields": fields})
