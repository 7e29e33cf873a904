"""create_app(engine, settings): the FastAPI app -- routes wired, errors, metrics, lifespan.

Knows: which routers make the app, the unauthenticated operational routes (/health: liveness,
/ready: readiness with each tier's state, for load balancers; /metrics for Prometheus;
/version; the /dashboard page's static files, whose data routes authenticate as always), the
per-request count by route and status and the per-request log line (service.request_log), and
the shutdown order: stop admitting (503), wait for in-flight requests (bounded by
settings.shutdown_timeout_s), then engine.close() -- which flushes cached blocks to disk (how
many is logged); the ledger is already committed, request by request.
Doesn't know: how the server process is run (service.server) or how routes work inside.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import cache_routes, dashboard, messages_routes, openai_routes, tokenize_routes
from service.auth import ApiKeys, require_admin
from service.context import AppContext, ctx
from service.dispatch import Dispatcher
from service.disconnect import ClientGone
from service.error_handlers import CatchAll, answer, install_error_handlers
from service.errors import APIError
from service.http_middleware import HTTPMiddleware, StatusSend
from service.metrics import ServiceMetrics
from service.openapi import install_openapi
from service.request_log import RequestLog
from service.body_parsing import IGNORED_HEADER, ignored_header_value
from service.settings import ServiceSettings, per_tenant_bound
from storage.tier_kinds import kinds

log = logging.getLogger("tieredkv.service")


def _installed_version() -> str:
    """The installed tieredkv distribution's version (tieredkv/__init__.py, a floor above, says the same)."""
    try:
        return importlib.metadata.version("tieredkv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__version__ = _installed_version()


def create_app(engine: Any, settings: ServiceSettings = ServiceSettings()) -> FastAPI:
    keys = ApiKeys.of(settings.api_keys_file, settings.api_keys, settings.admin_tenants)
    dispatcher = Dispatcher(settings.max_queue, per_tenant_bound(settings.max_inflight_per_tenant,
                                                                 getattr(engine, "max_seqs", None), settings.max_queue))
    metrics = ServiceMetrics(engine.cache_status, lambda: dispatcher.in_flight,
                             model_name=settings.served_model_name or engine.model_name,
                             max_model_len=getattr(engine, "max_context", None) or 8192)
    context = AppContext(engine, settings, keys, dispatcher, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sampler = asyncio.create_task(context.history.run(engine.cache_status))
        try:
            yield
        finally:
            sampler.cancel()
            await shutdown(context)

    # The OpenAPI document is served (clients and fuzzers read it), and drawn at /docs by
    # service.openapi (FastAPI's own pages load their scripts from a CDN: blank offline).
    app = FastAPI(title="tieredkv", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.tieredkv = context
    app.state.max_body_bytes = settings.max_body_bytes
    app.state.unknown_fields = settings.unknown_fields
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        context.client_gone(request.scope, exc.phase)
        return answer(request, exc)

    app.include_router(openai_routes.router)
    app.include_router(messages_routes.router)
    app.include_router(cache_routes.router)
    app.include_router(dashboard.router)
    app.include_router(tokenize_routes.router)

    @app.get("/health")
    async def health(request: Request) -> Any:
        """Liveness: the process serves HTTP and its engine loop runs (503 while shutting down,
        as load balancers expect). A degraded tier is not a reason to restart: see /ready."""
        c = ctx(request)
        if c.dispatcher.draining or c.engine_closed:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not engine_alive(c.engine):
            raise APIError(503, "the engine loop has stopped", code="engine_stopped")
        return {"status": "ok", "model": c.model_name, "in_flight": c.dispatcher.in_flight, "instance": c.instance}

    @app.get("/ready")
    async def ready(request: Request) -> Any:
        """Readiness: whether this server should get traffic now, with each tier's state. 503 when
        shutting down, when the engine loop stopped, or when billing cannot be written (requests
        would be answered with their bills only in memory: engine/billing_writer.py). A disk tier
        moved aside, unavailable or with its writes off, or an open remote breaker, is a smaller
        cache: reported, still ready."""
        c = ctx(request)
        try:
            status = await run_in_threadpool(c.engine.cache_status)
        except Exception as e:    # NOTE: a tier in trouble is a 503 with the reason, never a 500 (issue 28)
            log.error("/ready: the cache status failed", exc_info=e)
            status = {"error": f"the cache status failed ({type(e).__name__}: {e})"}
        body = readiness(status, draining=c.dispatcher.draining or c.engine_closed, alive=engine_alive(c.engine))
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/version")
    async def version() -> Any:
        """The tieredkv version serving (vLLM's /version)."""
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        c = ctx(request)
        if c.settings.protect_metrics and c.keys is not None:
            require_admin(c.caller(request))
        body = await run_in_threadpool(c.metrics.render)      # reads cache_status(): may block
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    install_openapi(app)
    # Added last, so it runs first (outermost): the error catch-all sits inside the counting.
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(CatchAll, on_disconnect=lambda scope: context.client_gone(
        scope, "body", "the client disconnected before its body was read"))
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_middleware(RequestLog, log_probes=settings.log_probes)   # outermost: its line has the client's status
    return app


def engine_alive(engine: Any) -> bool:
    alive = getattr(engine, "alive", None)     # duck-typed engines (tests, tools) may not say
    return alive is None or alive()


def readiness(status: dict, draining: bool, alive: bool) -> dict:
    """/ready's body: ready or not, why not, and each tier's state as cache_status reports it."""
    tiers = status.get("tiers", {})
    billing = status.get("billing", {"state": "off"})
    reasons = [status["error"]] if "error" in status else []
    if draining:
        reasons.append("shutting down")
    if not alive:
        reasons.append("the engine loop has stopped")
    if billing.get("state") == "degraded":
        held = f"{billing.get('unwritten')} bills held in {billing.get('held_in', 'memory')}"
        if billing.get("held_in_memory"):
            held += (f" ({billing['held_in_memory']} in memory, {billing.get('memory_bytes')} of "
                     f"{billing.get('memory_bound')} bytes: past that, requests get 503)")
        if billing.get("ledger") == "unavailable":
            reasons.append(f"billing: the ledger is unavailable ({billing.get('error')}); " + (
                f"{held}" if billing.get("on_failure") == "serve" else "requests are refused"))
        elif billing.get("on_failure") == "refuse":
            reasons.append(f"billing cannot be written ({billing.get('error')}); requests are refused")
        else:
            reasons.append(f"billing cannot be written ({held}: {billing.get('error')})")
    return {"ready": not reasons, "reasons": reasons,
            # Each tier's state as its kind's health reads its status (storage/tier_health.py), and
            # the fields its health names repeated under its name (the disk's).
            "tiers": {k.name: k.health.ready(tiers.get(k.name) or {}) for k in kinds()},
            **{k.name: {f: (tiers.get(k.name) or {}).get(f) for f in k.health.ready_fields
                        if f in (tiers.get(k.name) or {})}
               for k in kinds() if k.health.ready_fields},
            "billing": billing}


async def shutdown(c: AppContext) -> None:
    """Stop admitting, let in-flight requests finish (bounded), close the engine. Idempotent."""
    c.dispatcher.start_draining()
    if not await c.dispatcher.wait_idle(c.settings.shutdown_timeout_s):
        log.warning("shutdown: %d requests still in flight after %.0fs; closing the engine anyway",
                    c.dispatcher.in_flight, c.settings.shutdown_timeout_s)
    if c.settings.close_engine_on_shutdown and not c.engine_closed:
        c.engine_closed = True
        try:
            flushed = await asyncio.to_thread(c.engine.close)
            log.info("%s", closed_line(flushed))
        except Exception:       # logged, never "Application shutdown failed" (issue 28)
            log.exception("shutdown: closing the engine failed")
    c.dispatcher.shutdown()


def closed_line(flushed: Any) -> str:
    """What the engine's close flushed (engine.close()'s FlushResult; None from duck-typed engines)."""
    if flushed is None:
        return "engine closed"
    n = flushed.written
    line = f"engine closed: flushed {n} block{'s' if n != 1 else ''} down to the lowest tier"
    if flushed.complete:
        return line
    held = getattr(flushed, "held", None)
    if held is not None and held < flushed.blocks:
        line += (f"; the disk holds {held} of {flushed.blocks} cached blocks ({flushed.evicted} evicted to make "
                 "room)")
    return line + "; incomplete (lost writes are the disk's write_errors)"


class IgnoredFieldsHeader(HTTPMiddleware):
    """Lenient mode: a response to a request whose unknown fields were dropped names them in
    the X-Tieredkv-Ignored-Fields header (service.body_parsing.parse_body records them in the
    request's state, which is this scope's "state")."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = (scope.get("state") or {}).get("ignored_fields")
                if names:
                    value = ignored_header_value(names).encode("ascii")
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (IGNORED_HEADER.lower().encode(), value)]}
            await send(message)
        await self.app(scope, receive, send_wrapper)


class CountRequests(HTTPMiddleware):
    """Counts every HTTP response by route template and status (unmatched paths share one label,
    so a scanner cannot blow up the label set). FastAPI's own routes (/v1/...) name themselves in
    the scope; plain Starlette ones (/openapi.json) and mounts do not, so they are matched here."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = StatusSend(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            route = getattr(scope.get("route"), "path", None) or route_template(scope.get("app"), scope)
            self.metrics.requests.labels(route, str(sent.status)).inc()


def route_template(app: Any, scope: Scope) -> str:
    """The template of the app's route that matches `scope` (a path or a method match), or
    "unmatched"."""
    for route in getattr(getattr(app, "router", None), "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:      # a route that cannot judge this scope is not it
            continue
        if match != Match.NONE:
            return getattr(route, "path", None) or "unmatched"
    return "unmatched"

