"""The exception handlers: anything raised in a route -- ours, FastAPI's, Starlette's, or a bug --
answered with an error body in the shape its route's clients read (OpenAI's, service/errors.py;
Anthropic's on the Messages routes, service/messages_errors.py).

Knows: which handler answers what, and that a 500 keeps the connection open (CatchAll).
Doesn't know: routes, or which status a failure gets (service/errors.py).
"""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.errors import BillingUnavailable, EngineClosedError, QueueFullError
from service.errors import APIError, from_engine_error, validation_error
from service.http_middleware import HTTPMiddleware, StatusSend
from service.messages_errors import for_path
from service.request_log import record, scope_record

log = logging.getLogger("tieredkv.service")


def shaped(path: str, err: APIError) -> APIError:
    """The error as the clients of `path` read it: Anthropic's shape on the Messages routes
    (service/messages_errors.py), OpenAI's everywhere else."""
    return for_path(path, err)


def answer(request: Request, err: APIError) -> JSONResponse:
    """The error's response (in the shape its route's clients read), its message noted for the
    request's log line."""
    record(request).reason = err.message
    return shaped(request.url.path, err).response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"unknown route: {request.method} {request.url.path}", code="unknown_url")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return answer(request, err)

    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineClosedError)
    @app.exception_handler(BillingUnavailable)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, from_engine_error(exc))

    # Anything else is answered by service.app.CatchAll (a 500 that keeps the connection open).


class CatchAll(HTTPMiddleware):
    """Any exception a route lets escape becomes a 500 with OpenAI's body (never Starlette's plain
    text), logged, and the connection stays open. (A FastAPI handler for Exception runs in
    Starlette's outermost middleware, which re-raises after answering; uvicorn then drops the
    keep-alive connection.) Once a response has started nothing well-formed can be sent, so the
    error propagates. `what` names the process in the body ("server", "router") and `logger`
    (with `log_prefix`) is where it is logged; `record_reason`: the request log's record takes the error's message
    (the server's request log; the router keeps none).
    A client that closed its connection while its body was read (Starlette's ClientDisconnect,
    where no route turned it into service/disconnect.py's ClientGone) is no error: no traceback,
    a 499 nobody reads, and `on_disconnect(scope)` (which counts it and says it in one line)."""

    def __init__(self, app: ASGIApp, what: str = "server", logger: logging.Logger = log, log_prefix: str = "",
                 record_reason: bool = True, on_disconnect: Callable[[Scope], None] | None = None) -> None:
        super().__init__(app)
        self.what, self.log, self.log_prefix, self.record_reason = what, logger, log_prefix, record_reason
        self.on_disconnect = on_disconnect

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = StatusSend(send)
        try:
            await self.app(scope, receive, sent)
        except ClientDisconnect:
            if self.on_disconnect is not None:
                self.on_disconnect(scope)
            if not sent.started:
                gone = APIError(499, "the client disconnected before its body was read", code="client_disconnected")
                await shaped(scope.get("path", ""), gone).response()(scope, receive, sent)
        except Exception:
            self.log.exception("%sunhandled error in %s %s", self.log_prefix, scope.get("method"), scope.get("path"))
            if sent.started:
                raise      # a response is under way: nothing well-formed can be sent now
            err = APIError(500, f"internal {self.what} error", code="internal_error")
            if self.record_reason:
                scope_record(scope).reason = err.message
            await shaped(scope.get("path", ""), err).response()(scope, receive, send)
