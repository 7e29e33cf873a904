"""How long a client may take to send its request, and how large a chunk it may declare: the
connection's read limits, for the service and the router alike (issue 44, item 5).

Knows: uvicorn's h11 protocol, which reads forever -- a client that opens a connection and sends
half a request line, or headers and then a byte a minute, holds it as long as it likes; and h11,
which takes a chunk-size line of `FFFFFFFFFFFFFFFF` and then waits for that many bytes.
`ReadLimitsProtocol` (an `H11Protocol`, used whether or not httptools is installed) adds:
- a header deadline: the request line and headers whole within `header_timeout_s` of the
  connection opening or of the request's first byte; past it a 408 (a connection that sent
  nothing is closed without one, as an idle keep-alive connection is);
- a body deadline: `body_timeout_s` after the headers, moved on by a second for every
  BODY_MIN_RATE bytes received, so a body arriving at 64 KiB/s or faster always finishes (the
  largest default body, 8 MiB, gets 158 s) and a trickle is cut after about `body_timeout_s`.
  While the server itself is not reading (its buffer full until the app reads it) the clock
  starts over when checked. Past it a 408, or a plain close once a response has begun;
- a chunk-size line that announces more than `max_body_bytes` still to come is a 413 at once,
  with no wait for its bytes (a Content-Length past it is the app's 413: service/request_body.py;
  bytes past it, however chunked, the app's too).
Each refusal is OpenAI's error body with `Connection: close`, then the connection is closed.
The app, if it was reading that body, sees a disconnect; `refusal(scope)` tells it what the
client was answered, so its request log says 408/413 and not a client that left (499).
Timers run on the event loop that owns the connection; nothing here is shared between threads.
Doesn't know: routes, the app's own limits, or how many connections there are.
"""
from __future__ import annotations

import http
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import APIError

log = logging.getLogger("tieredkv.service")

# A body's deadline moves on by one second per this many bytes received: 64 KiB/s (512 kbit/s).
BODY_MIN_RATE = 64 << 10
_SCOPE_KEY = "tieredkv.read_limits"        # in scope["extensions"]: the APIError the connection answered


@dataclass(frozen=True)
class ReadLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected an int >= 1, got {self.max_body_bytes!r}")


def refusal(scope: dict[str, Any]) -> APIError | None:
    """What the connection answered this request, if it refused it (the app saw a disconnect)."""
    return (scope.get("extensions") or {}).get(_SCOPE_KEY)


def http_protocol(limits: ReadLimits) -> type["ReadLimitsProtocol"]:
    """uvicorn.Config(http=...): the protocol class with these limits."""
    return type("ReadLimitsProtocol", (ReadLimitsProtocol,), {"limits": limits})


def _declared_chunk_left(conn: h11.Connection) -> int:
    """Bytes the chunk being read still declares (0 when not reading a chunked body).
    NOTE: h11 keeps it in its ChunkedReader's `_bytes_in_chunk` (h11 0.14-0.16) and says it
    nowhere else; tests/service/test_http_limits.py fails if that moves."""
    left = getattr(getattr(conn, "_reader", None), "_bytes_in_chunk", 0)
    return left if isinstance(left, int) else 0


class ReadLimitsProtocol(H11Protocol):
    limits = ReadLimits()

    def connection_made(self, transport: Any) -> None:       # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: Any = None
        self._body_timer: Any = None
        self._body_start = 0.0
        self._body_bytes = 0
        self._arm_header()       # a connection that says nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)         # handle_events, then _watch

    def handle_events(self) -> None:
        super().handle_events()
        if not self.transport.is_closing():
            self._watch()

    # ---- the deadlines ----------------------------------------------------------------------
    def _watch(self) -> None:
        """After h11 has read what arrived: which deadline the request is under now."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._header_timer is None and self.conn.trailing_data[0]:
                self._arm_header()       # a request's first bytes: its headers' clock starts
        elif self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if state is not h11.SEND_BODY:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            return
        if self._body_timer is None:
            self._body_start, self._body_bytes = time.monotonic(), 0
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._check_body)
        if _declared_chunk_left(self.conn) > self.limits.max_body_bytes:
            self._refuse(APIError(413, f"request body: a chunk declares more than the server's limit of "
                                       f"{self.limits.max_body_bytes} bytes", code="request_too_large"))

    def _arm_header(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:
            self.transport.close()       # nothing sent: nothing to answer
            return
        log.debug("closing a connection from %s: no whole request line and headers in %gs", self.client,
                  self.limits.header_timeout_s)
        self._write(APIError(408, f"the request line and headers did not arrive within "
                                  f"{self.limits.header_timeout_s:g}s", code="timeout"))
        self.transport.close()

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        now = time.monotonic()
        if self.flow.read_paused:     # the server is not reading: not the client's time
            self._body_start, self._body_bytes = now, 0
        deadline = self._body_start + self.limits.body_timeout_s + self._body_bytes / BODY_MIN_RATE
        if now < deadline:
            self._body_timer = self.loop.call_later(deadline - now, self._check_body)
            return
        self._refuse(APIError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g}s "
                                   f"(plus a second per {BODY_MIN_RATE >> 10} KiB received)", code="timeout"))

    # ---- refusing ---------------------------------------------------------------------------
    def _refuse(self, err: APIError) -> None:
        """Answer `err` (unless a response has begun), tell the app, close the connection."""
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self._write(err)
        if cycle is not None and not cycle.response_complete:
            self.scope.setdefault("extensions", {})[_SCOPE_KEY] = err
            cycle.disconnected = True      # the app's sends are dropped; its receive says "disconnect"
            cycle.message_event.set()
        self._cancel_timers()
        self.transport.close()

    def _write(self, err: APIError) -> None:
        # Written past h11: the connection closes right after, and before a request line h11
        # has no state to send a response from.
        body = json.dumps(err.body()).encode()
        head = (f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode("latin-1") + body)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None
