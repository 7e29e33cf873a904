"""What every route of one app shares: the engine, settings, keys, dispatcher and metrics.

Knows: how a route gets at them (`ctx(request)`) and the per-request checks every route
repeats: who is calling, whether the named model is the one served (its served name or its
own), whether a prompt is small enough to be worth tokenizing and its max_tokens fits the context;
what a finished or abandoned generation request reports (metrics, its log line, its answer).
Doesn't know: any route's logic.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.abort import TIMEOUT
from service.auth import ApiKeys, Caller, authorization_of, resolve_caller
from service.disconnect import ClientGone
from service.dispatch import Abandoned, Dispatcher
from service.errors import APIError, bad_request
from service.hit_history import HitHistory
from service.metrics import ServiceMetrics
from service.request_log import record, scope_record
from service.settings import ServiceSettings

# A token is a few bytes of text (about 4 in English); 32 leaves room for any real prompt that fits.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass
class AppContext:
    engine: Any                    # engine.engine.Engine (duck-typed: tests and tools may wrap it)
    settings: ServiceSettings
    keys: ApiKeys | None
    dispatcher: Dispatcher
    metrics: ServiceMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    # This process's run, in /health: a router sees a restarted backend by it (its caches are new).
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    engine_closed: bool = False
    # Hit tokens by tier over the last minutes, for the dashboard's first paint (service/hit_history.py).
    history: HitHistory = field(default_factory=HitHistory)

    @property
    def model_name(self) -> str:
        """The name clients see: the served name when one is set, else the engine's."""
        return self.settings.served_model_name or self.engine.model_name

    def authenticate(self, request: Request, x_api_key: bool = False) -> None:
        """With keys, a request without a valid one stops here (401), before its body is read.
        `x_api_key`: Anthropic's header is taken as well as Authorization (the Messages routes)."""
        if self.keys is not None:
            self.keys.caller(_authorization(request, x_api_key))

    def caller(self, request: Request, user: object = None, x_api_key: bool = False,
               user_field: str = "user") -> Caller:
        header = _authorization(request, x_api_key) if self.keys is not None else None
        caller = resolve_caller(self.keys, header, user, user_field)
        record(request).tenant = caller.tenant
        return caller

    def finished(self, request: Request, request_id: str, usage: Any, metrics: Any, finish_reason: str | None = None,
                 intervals: list[float] | None = None) -> None:
        """A generation request's result: counted in the metrics, written in its log line.
        `request_id`: the id its body and x-request-id carry (`cmpl-...`, `chatcmpl-...`)."""
        self.metrics.observe_request(usage, metrics, finish_reason, intervals)
        record(request).finished(request_id, usage, metrics)

    def client_gone(self, scope: dict, phase: str, why: str | None = None) -> None:
        """A client that closed its connection (service/disconnect.py): counted by `phase`, and
        `why` noted for its log line (one INFO line: a client's event, never a server error)."""
        self.metrics.client_disconnects.labels(phase).inc()
        if why is not None:
            scope_record(scope).reason = why

    def abandoned(self, request: Request, gone: Abandoned, out: Any, request_id: str | None) -> Response:
        """A non-streamed request given up (dispatch.Abandoned; `out` its output once aborted, or
        None): past its timeout a 504 (raised); its client gone, the 499 nobody reads (returned),
        counted as a disconnect in the "queued" phase. Both logged and billed by aborted()."""
        if gone.reason == TIMEOUT:
            why = f"the request took longer than {self.settings.request_timeout_s:g}s"
            raise APIError(504, self.aborted(request, out, why, request_id), code="timeout") from None
        why = self.aborted(request, out, "the client disconnected before its response", request_id)
        self.client_gone(request.scope, "queued")
        return ClientGone("queued", why).response()

    def aborted(self, request: Request, out: Any, why: str, request_id: str | None = None) -> str:
        """A generation request abandoned (its client gone, or past its timeout), as its log line
        says it (returned): its bill's tokens are counted (its latencies are not: it did not
        finish). `out`: the engine's output once aborted (None when it did not end in time; one
        that had finished first is counted as finished)."""
        rec = record(request)
        if out is not None and out.finish_reason != "abort":
            self.finished(request, request_id or out.request_id, out.usage, out.metrics, out.finish_reason)
            rec.reason = f"{why} (it had finished)"
            return rec.reason
        rec.reason = f"{why}; the request was aborted"
        if out is not None:
            self.metrics.observe_request(out.usage, None, "abort")
            rec.finished(request_id or out.request_id, out.usage, None)
        return rec.reason

    @property
    def max_prompt_bytes(self) -> int:
        return self.settings.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.engine.max_context

    def check_prompt_size(self, prompt: Any = None, messages: Any = None) -> None:
        """400 for a prompt that cannot fit the context, found without tokenizing it: text (or
        chat messages' contents, summed) longer in UTF-8 than max_prompt_bytes, or more token
        ids than the context holds. (An 8 MB prompt was tokenized in full before the engine's
        length check refused it.)"""
        if isinstance(prompt, list):
            context = self.engine.max_context
            if len(prompt) >= context:
                raise bad_request(f"prompt: {len(prompt)} tokens leave no room to generate within the context "
                                  f"of {context} tokens", param="prompt")
            return
        field = "prompt" if messages is None else "messages"
        texts = [prompt] if messages is None else [m.content for m in messages]
        limit = self.max_prompt_bytes
        size = 0
        for text in texts:
            if isinstance(text, str):
                size += len(text) if len(text) > limit else len(text.encode("utf-8"))
            if size > limit:
                how = "max_prompt_bytes" if self.settings.max_prompt_bytes else \
                    f"{PROMPT_BYTES_PER_TOKEN} bytes per token of the model's {self.engine.max_context}-token context"
                raise bad_request(f"{field}: more than {limit} bytes of UTF-8 text, the most this server tokenizes "
                                  f"({how}); shorten it", param=field)

    def with_room(self, ids: list[int], max_tokens: int | None) -> list[int]:
        """The prompt ids, after checking that an explicit max_tokens fits the context (400, as vLLM
        does: never silently clamped). A default max_tokens is cut at the context's end instead."""
        context = self.engine.max_context
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise ValueError(f"max_tokens: the context is {context} tokens and the prompt takes {len(ids)}, "
                             f"so at most {context - len(ids)} can be generated; {max_tokens} were asked for")
        return ids

    def check_model(self, model: str) -> None:
        """404 unless `model` is the served name or the engine's own model name."""
        if model not in (self.model_name, self.engine.model_name):
            raise APIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def ctx(request: Request) -> AppContext:
    return request.app.state.tieredkv


def _authorization(request: Request, x_api_key: bool) -> str | None:
    headers = request.headers
    return authorization_of(headers.get("authorization"), headers.get("x-api-key") if x_api_key else None)
