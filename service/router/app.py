"""create_router_app(settings): the router's FastAPI app.

Knows: the routes -- POST /v1/completions and /v1/chat/completions (routed by prefix and load),
GET /v1/models[/{id}] (to any backend up), GET /health (200 while a backend is up, with each
backend's state and event stream; 503 when none is) and GET /metrics -- and the lifespan: one
httpx client, the backend set's first health check before the first request, and its health
loop and subscribers stopped at shutdown. The router checks no key itself: the Authorization
header goes to the backend, which does (and which alone derives the tenant). A generation body
is parsed as a backend parses it (service.schemas: 415 unless JSON, 400 for malformed JSON or
UTF-8, nesting too deep, a huge integer, a non-object, a lone surrogate) and refused here with
the backend's status and OpenAI's error body; its fields are the backend's to validate (it may
run with --lenient-fields), and its 400 is relayed. Every answer of the router's own is
OpenAI's JSON error body, an exception that escapes a route included (a 500). A client that
leaves (before its body was read, before its answer began, mid-stream) is a 499 nobody reads,
counted and said in one INFO line (proxy.client_gone), never a 500 or a traceback. Every request
is one line of the router's request log (request_log.py: id, tenant, backend, cache_key).
Doesn't know: how a backend is chosen (policy.py) or forwarded to (proxy.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from service.disconnect import ClientGone, until_disconnected
from service.error_handlers import CatchAll, install_error_handlers
from service.errors import APIError
from service.request_body import read_limited
from service.router.backends import BackendSet
from service.router.index import PrefixIndex
from service.router.metrics import RouterMetrics
from service.router.policy import Policy
from service.router.proxy import Proxy, error
from service.router.request_log import RouterRequestLog, note_prompt
from service.request_log import scope_record
from service.router.settings import RouterSettings
from service.body_parsing import check_json_content_type, decode_json_object

log = logging.getLogger("tieredkv.router")


class Router:
    """What the routes share: the settings, the index, the backend set, the proxy."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.prediction_ttl_s)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.backends = BackendSet(list(settings.backends), self.index, self.client,
                                   health_interval_s=settings.health_interval_s,
                                   health_timeout_s=settings.health_timeout_s, api_key=settings.api_key,
                                   replay_timeout_s=settings.replay_timeout_s,
                                   eject_cooldown_s=settings.eject_cooldown_s,
                                   eject_cooldown_max_s=settings.eject_cooldown_max_s,
                                   curve_keypair=settings.curve_keypair,
                                   pinned_server_keys=settings.pinned_server_keys)
        self.metrics = RouterMetrics(self.backends)
        self.proxy = Proxy(self.backends, self.index, Policy(settings.in_flight_tokens, settings.queue_weight, dict(settings.weights)),
                           self.metrics, self.client, hash_timeout_s=settings.hash_timeout_s)

    async def start(self) -> None:
        await self.backends.start()

    async def stop(self) -> None:
        await self.backends.stop()
        await self.client.aclose()


def create_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="tieredkv router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    install_error_handlers(app)             # 404/405 and the like in OpenAI's body
    app.add_middleware(CatchAll, what="router", logger=log, log_prefix="router: ", record_reason=False,
                       on_disconnect=lambda scope: router.proxy.client_gone(
                           "body", f"{scope.get('method')} {scope.get('path')}"))
    app.add_middleware(RouterRequestLog, log_probes=settings.log_probes)   # outermost: the client's status

    async def generation(request: Request, chat: bool) -> Response:
        what = f"POST {request.url.path}"
        try:
            check_json_content_type(request.headers.get("content-type"))
            body = await read_limited(request, settings.max_body_bytes)
            if body is None:
                return error(413, f"request body: larger than the router's limit of {settings.max_body_bytes} bytes",
                             "request_too_large")
            doc = decode_json_object(body)
        except APIError as e:
            return e.response()             # what a backend would answer, without asking one
        except ClientDisconnect:
            router.proxy.client_gone("body", what)
            return ClientGone("body", "the client disconnected before its body was read").response()
        headers = dict(request.headers)
        # OpenAI's prompt_cache_key: the backend validates it (a 400 is relayed); a string is logged
        # and keeps the key's requests on one backend (sticky.py).
        cache_key = doc.get("prompt_cache_key")
        cache_key = cache_key if isinstance(cache_key, str) and cache_key else None
        scope_record(request.scope).cache_key = cache_key

        async def routed() -> Response:
            blocks = await router.proxy.prompt_blocks(chat, doc, headers)
            if blocks is not None:
                note_prompt(request.scope, blocks.tenant, blocks.prompt_tokens)
            return await router.proxy.forward("POST", request.url.path, body, headers, blocks,
                                              sse=doc.get("stream") is True, cache_key=cache_key)
        # A client that leaves before its answer begins: the forward is cancelled (its connection to
        # the backend closed, so the backend aborts the request), counted, one INFO line.
        work = asyncio.ensure_future(routed())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled() or not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await work
            router.proxy.client_gone("queued", what)
            return ClientGone("queued", "the client disconnected before its answer began").response()
        return work.result()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.proxy.forward("GET", "/v1/models", b"", dict(request.headers))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        return await router.proxy.forward("GET", request.url.path, b"", dict(request.headers))

    @app.get("/health")
    async def health() -> Any:
        views = [b.view(router.index) for b in router.backends.backends]
        up = sum(v["healthy"] for v in views)
        body = {"status": "ok" if up else "no backend up", "backends_up": up, "backends": views}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app

