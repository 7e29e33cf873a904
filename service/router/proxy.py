"""Forwarding one request: its block hashes, the backend chosen for it, the bytes relayed.

Knows: the steps. (1) The prompt's block hashes come from one healthy backend's
POST /v1/cache/block_hashes, asked with the caller's own Authorization header and `user` (the
hashes are namespaced by the tenant, which only a backend derives); when that fails -- a bad
body, a bad key, an older backend -- the request is routed as a miss and the backend it reaches
gives the client the real error. (2) The policy picks a backend among the healthy ones not
tried yet; the prompt's blocks are predicted onto it at once (index.predict), so the next
request for the same new prefix follows; a request with a `prompt_cache_key` sticks to the backend
its key's last request went to while that one is in rotation (sticky.py; policy.py weighs it). (3) The request goes out with the client's headers
(Authorization included; hop-by-hop ones dropped) and the router waits for the answer's status
line, then for the answer to be judged (relay.py: a whole body, or a stream's first event).
A 503 (the backend is shutting down) or a 429 (its queue is full) sends the request to the
next backend while another is left; so does an answer that must not reach the client -- a
connection refused or timed out, garbage, a 5xx -- and that answer ejects its backend
(ejection.py: out until a probe readmits it). A connection dropped before an answer (reset,
closed: perhaps a keep-alive race with a live backend) is retried too, and ejects after two in a
row. Nothing has reached the client yet. When every backend failed, the client gets the last
backend's own JSON error, or the router's 502. (4) From then on a stream is relayed event by
event as events complete (usage chunks and all), each checked (relay.py).
A retried request may have been partly run on the backend that failed (its bill included):
that is the price of never failing a request a live backend could answer.
A client that leaves (service/disconnect.py's phases) is `client_gone`: counted, one INFO line;
its request to the backend is cut off (the connection closed: the backend aborts it).
Doesn't know: the HTTP app (app.py) or how the cheapest backend is computed (policy.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from service.router import answers
from service.router.backends import Backend, BackendSet
from service.router.index import PrefixIndex
from service.router.metrics import RouterMetrics
from service.router.policy import Candidate, Choice, Policy, choose
from service.router.relay import Refused, receive
from service.router.sticky import StickyMap, tenant_of

log = logging.getLogger("tieredkv.router")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
BACKEND_HEADER = "x-tieredkv-backend"
# Failures that mean the request never got a usable answer from the backend: safe to send elsewhere.
# A connection that cannot be made, and a timeout, eject the backend at once; a dropped one (DROPPED)
# may be a keep-alive race with a live backend: two in a row eject it.
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
RETRYABLE = (httpx.ConnectError, httpx.TimeoutException, httpx.NetworkError, httpx.ProtocolError)
DROPS_TO_EJECT = 2


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    hashes: list[bytes]
    block_size: int
    prompt_tokens: int
    tenant: str | None = None          # the tenant the backend derived from the caller's key


def error(status: int, message: str, code: str) -> JSONResponse:
    types = {502: "server_error", 503: "service_unavailable", 504: "timeout", 413: "invalid_request_error",
             400: "invalid_request_error", 415: "invalid_request_error"}
    return JSONResponse({"error": {"message": message, "type": types.get(status, "server_error"), "param": None,
                                   "code": code}}, status_code=status)


class InFlight:
    """One request counted in its backend's in-flight count until released (once), and its
    predicted prefill in the backend's pending tokens until its answer starts (its first byte
    means the prefill is done: a stream's first chunk, or a whole body)."""

    def __init__(self, b: Backend, prefill_tokens: int) -> None:
        self.backend: Backend | None = b
        self.pending = prefill_tokens
        b.in_flight += 1
        b.pending_tokens += prefill_tokens

    def started(self) -> None:
        if self.backend is not None:
            self.backend.pending_tokens -= self.pending
        self.pending = 0

    def __call__(self) -> None:
        self.started()
        if self.backend is not None:
            self.backend.in_flight -= 1
            self.backend = None


class Proxy:
    def __init__(self, backends: BackendSet, index: PrefixIndex, policy: Policy, metrics: RouterMetrics,
                 client: httpx.AsyncClient, hash_timeout_s: float = 30.0, sticky: StickyMap | None = None) -> None:
        self.backends = backends
        self.sticky = sticky if sticky is not None else StickyMap(index.prediction_ttl_s)
        backends.on_out.append(lambda b: self.sticky.drop_backend(b.name))
        self.index = index
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.hash_timeout_s = hash_timeout_s

    # ---- (1) block hashes ----------------------------------------------------------------
    async def prompt_blocks(self, chat: bool, doc: Any, headers: dict[str, str]) -> PromptBlocks | None:
        field = "messages" if chat else "prompt"
        if not isinstance(doc, dict) or field not in doc:
            return None
        body = {field: doc[field]}
        if doc.get("user") is not None:
            body["user"] = doc["user"]
        up = sorted(self.backends.healthy(), key=lambda b: (b.in_flight, b.routed))
        if not up:
            return None
        b = up[0]
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            r = await self.client.post(f"{b.url}/v1/cache/block_hashes", json=body, headers=auth,
                                       timeout=self.hash_timeout_s)
        except httpx.HTTPError as e:
            self.metrics.hash_lookups.labels("transport_error").inc()
            log.debug("router: block hashes from %s failed: %s", b.url, e)
            if isinstance(e, httpx.ConnectError):
                b.was_down = True
                self.backends.eject(b, f"{type(e).__name__}: {e}", "connect")
            return None
        got = answers.json_object(r.content)
        if r.status_code >= 500 or (r.status_code == 200 and got is None):
            # A 5xx, or a 200 that is not JSON: the backend is in trouble (a 4xx is the body's fault).
            label = f"http_{r.status_code}" if r.status_code >= 500 else "bad_hashes"
            self.metrics.hash_lookups.labels(label).inc()
            self.backends.eject(b, f"/v1/cache/block_hashes answered {r.status_code}: {answers.quoted(r.content)}",
                                label, request=True)
            return None
        if r.status_code != 200:
            self.metrics.hash_lookups.labels(f"http_{r.status_code}").inc()
            if r.status_code == 404:
                b.warn_once("no-hashes", "router: backend %s has no /v1/cache/block_hashes (an older tieredkv?); "
                            "requests are routed by load only", b.url)
            return None
        try:
            blocks = PromptBlocks([bytes.fromhex(h) for h in got["hashes"]], int(got["block_size"]),
                                  int(got.get("prompt_tokens") or len(got["hashes"]) * int(got["block_size"])),
                                  got["tenant"] if isinstance(got.get("tenant"), str) else None)
        except (ValueError, KeyError, TypeError, OverflowError):
            self.metrics.hash_lookups.labels("bad_answer").inc()
            return None
        self.metrics.hash_lookups.labels("ok").inc()
        return blocks

    # ---- (2)-(4) choose, send, relay -----------------------------------------------------
    def _choose(self, blocks: PromptBlocks | None, tried: set[str],
                sticky_key: tuple[str, str] | None = None) -> tuple[Backend, Choice] | None:
        up = [b for b in self.backends.healthy() if b.name not in tried]
        if not up:
            return None
        candidates = [Candidate(b.name, b.in_flight, b.routed, b.pending_tokens) for b in up]
        stuck = None if sticky_key is None else self.sticky.get(sticky_key, {b.name for b in up})
        if blocks is None:
            choice = choose(self.policy, candidates, {}, 0, 1, sticky=stuck)
        else:
            prefixes = self.index.prefix(blocks.hashes, [c.name for c in candidates])
            choice = choose(self.policy, candidates, prefixes, blocks.prompt_tokens, blocks.block_size, sticky=stuck)
        return self.backends.by_name(choice.backend), choice

    async def forward(self, method: str, path: str, body: bytes, headers: dict[str, str],
                      blocks: PromptBlocks | None = None, sse: bool = False, cache_key: str | None = None) -> Response:
        """`cache_key`: the body's prompt_cache_key (a string), if any."""
        sticky_key = None if cache_key is None else \
            (tenant_of(blocks.tenant if blocks is not None else None, headers), cache_key)
        out_headers = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        kind = answers.kind_of(method, path)
        tried: set[str] = set()
        last_error: Response | None = None       # the last backend's own (good) error answer
        while True:
            picked = self._choose(blocks, tried, sticky_key)
            if picked is None:
                if last_error is not None:
                    return last_error
                if tried:
                    self.metrics.failed.labels("all_backends_failed").inc()
                    return error(502, f"no backend could take the request ({len(tried)} tried)", "backends_failed")
                self.metrics.failed.labels("no_backend_up").inc()
                return error(503, "no backend is up", "no_backend")
            b, choice = picked
            tried.add(b.name)
            if blocks is not None:
                self.index.predict(b.name, blocks.hashes)
            if sticky_key is not None:
                self.sticky.set(sticky_key, b.name)
            b.routed += 1
            release = InFlight(b, choice.miss_tokens)
            upstream: httpx.Response | None = None
            try:
                req = self.client.build_request(method, f"{b.url}{path}", content=body or None, headers=out_headers)
                upstream = await self.client.send(req, stream=True)
                if upstream.status_code in (429, 503) and self._others_up(tried):
                    await upstream.aclose()
                    release()
                    if upstream.status_code == 503:
                        self.backends.mark_down(b, "answered 503")
                    self.metrics.retries.labels(b.url, f"http_{upstream.status_code}").inc()
                    continue
                got = await receive(upstream, kind, sse, {BACKEND_HEADER: b.url}, release.started,
                                    lambda reason, label, b=b: self._broken(b, reason, label), release,
                                    lambda b=b: self.client_gone("streaming", f"{method} {path}", b.url))
            except RETRYABLE as e:
                if upstream is not None:
                    await upstream.aclose()
                release()
                self._transport_failed(b, e)
                log.warning("router: %s %s on %s failed before any byte was sent (%s: %s); trying another backend",
                            method, path, b.url, type(e).__name__, e)
                continue
            except BaseException:
                if upstream is not None:
                    await upstream.aclose()
                release()
                raise
            if isinstance(got, Refused):
                self._refused(b, got.reason, got.label)
                continue
            status = upstream.status_code
            if status == 503:               # shutting down, and no other backend is left to try
                self.backends.mark_down(b, "answered 503")
            elif status >= 500:
                # A good error body, but a 5xx: the backend is in trouble; another may answer.
                last_error = got
                self._refused(b, f"answered {status}", f"http_{status}")
                continue
            b.dropped = b.refused_in_row = 0
            self.metrics.requests.labels(b.url, str(status)).inc()
            if blocks is not None and status == 200:
                self.metrics.prompt_tokens.labels(b.url).inc(blocks.prompt_tokens)
                self.metrics.predicted_hit_tokens.labels(b.url).inc(choice.hit_tokens)
            return got

    def client_gone(self, phase: str, what: str, backend: str | None = None) -> None:
        """A client that closed its connection (service/disconnect.py's phases): one INFO line and
        a count, never an error (nor the backend's fault: it is not ejected)."""
        self.metrics.client_disconnects.labels(phase).inc()
        where = {"body": "before its body was read", "queued": "before its answer began",
                 "streaming": "mid-stream"}[phase]
        log.info("router: %s: the client disconnected %s%s (499)", what, where,
                 f"; its request on {backend} was cut off" if backend else "")

    def _others_up(self, tried: set[str]) -> bool:
        return any(b.name not in tried for b in self.backends.healthy())

    def _refused(self, b: Backend, reason: str, label: str) -> None:
        """`b`'s answer is not passed on: ejected (ejection.py), the request tried elsewhere."""
        log.warning("router: backend %s: refused its answer (%s); trying another backend", b.url, reason)
        self.backends.eject(b, reason, label, request=True)
        self.metrics.retries.labels(b.url, label).inc()

    def _broken(self, b: Backend, reason: str, label: str) -> None:
        """A stream broke after its first event reached the client: too late to retry."""
        log.warning("router: backend %s broke a stream: %s", b.url, reason)
        self.backends.eject(b, reason, label, request=True)

    def _transport_failed(self, b: Backend, e: Exception) -> None:
        reason = f"{type(e).__name__}: {e}"
        if isinstance(e, DROPPED):
            b.dropped += 1
            if b.dropped >= DROPS_TO_EJECT:
                self.backends.eject(b, f"{b.dropped} connections dropped in a row: {reason}", "dropped", request=True)
        elif isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            self.backends.eject(b, reason, "timeout", request=True)
        else:                       # no connection: not the request's doing, so even the last backend goes
            b.was_down = True       # it may come back a new process
            self.backends.eject(b, reason, "connect")
        self.metrics.retries.labels(b.url, type(e).__name__).inc()
