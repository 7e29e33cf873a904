"""Errors as OpenAI writes them: `{"error": {"message", "type", "param", "code"}}`, for every failure
(on the Messages routes, Anthropic's shape: service/messages_errors.py).

Knows: which HTTP status and error type each failure gets, and the exception handlers that
turn anything raised in a route -- ours, FastAPI's, Starlette's, or a bug -- into that body.
Validation errors are 400 (as OpenAI's are), never FastAPI's default 422.
Doesn't know: routes or the engine beyond its error classes (engine/errors.py).
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
from service.http_middleware import HTTPMiddleware, StatusSend
from service.request_log import record, scope_record

log = logging.getLogger("tieredkv.service")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error",
          429: "rate_limit_error", 499: "client_closed_request", 500: "server_error", 503: "service_unavailable",
          504: "timeout"}
# A 429's Retry-After: a slot opens when one of the requests in flight ends, which is usually
# within a second or two of a busy server's decoding; the client backs off that long first.
RETRY_AFTER_S = 1
# A 503 for billing (the ledger's filesystem cannot be written, and the bills held are at their
# bound): the ledger is retried every 2 s, but a filesystem comes back in seconds at best.
BILLING_RETRY_AFTER_S = 10


class APIError(Exception):
    """A failure the client is told about: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        # Seconds a client should wait before trying again (the Retry-After header): every 429 has it.
        self.retry_after_s = retry_after_s if retry_after_s is not None or status != 429 else RETRY_AFTER_S

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: BaseException) -> APIError:
    """What the client hears about an exception raised by an engine call."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, f"the server is busy: {exc}", code="queue_full")
    if isinstance(exc, BillingUnavailable):
        return APIError(503, str(exc), code="billing_unavailable", retry_after_s=BILLING_RETRY_AFTER_S)
    if isinstance(exc, EngineClosedError):
        return APIError(503, f"the engine is shutting down: {exc}", code="engine_closed")
    if isinstance(exc, ValueError):
        # NOTE: the engine raises ValueError for bad input only (empty or too long prompt,
        # ids outside the vocabulary, bad sampling values); its message names the field.
        return bad_request(str(exc), param=_field_of(str(exc)))
    log.error("unexpected error in an engine call", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def _field_of(message: str) -> str | None:
    """'max_tokens: expected ...' -> 'max_tokens' (the project's ValueErrors start with the field)."""
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def param_of(loc: tuple) -> str:
    """A pydantic error location -> OpenAI's param: ('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error, as a 400 naming its field."""
    if not errors:
        return bad_request("invalid request")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", code="invalid_json")
    param = param_of(tuple(e.get("loc", ())))
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "missing":
        msg = "required field is missing"
    elif e.get("type") == "extra_forbidden":
        msg = "unrecognized field"
    return bad_request(f"{param or 'request body'}: {msg}", param=param or None)


def shaped(path: str, err: APIError) -> APIError:
    """The error as the clients of `path` read it: Anthropic's shape on the Messages routes
    (service/messages_errors.py), OpenAI's everywhere else."""
    from service.messages_errors import for_path       # lazily: that module builds on this one
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
