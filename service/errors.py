"""Errors as OpenAI writes them: `{"error": {"message", "type", "param", "code"}}`, for every failure
(on the Messages routes, Anthropic's shape: service/messages_errors.py builds on this one).

Knows: which HTTP status and error type each failure gets (`APIError`), an engine error's,
a validation error's (400, as OpenAI's are, never FastAPI's default 422).
Doesn't know: routes, the engine beyond its error classes (engine/errors.py), or the handlers
that answer with these (service/error_handlers.py).
"""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from engine.errors import BillingUnavailable, EngineClosedError, QueueFullError

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
