"""Errors as Anthropic writes them, on the Messages routes (/v1/messages and everything under it):
`{"type": "error", "error": {"type": ..., "message": ...}}`, with the HTTP status our OpenAI
routes give the same failure.

Knows: Anthropic's error type for each status (400 invalid_request_error, 401
authentication_error, 403 permission_error, 404 not_found_error, 413 request_too_large, 429
rate_limit_error, 500 api_error, 503 overloaded_error, 504 timeout_error), which paths take this
shape -- every error answered on them, raised by a route or by the app's own handlers (an unknown
method, a 500), goes through `for_path` (service/error_handlers.py's `shaped` calls it). The message
keeps the field it names ("messages[0].content: ..."); Anthropic's body has no `param` or `code`.
Doesn't know: routes, why an error happened, or how a stream frames one (service/messages_responses.py).
"""
from __future__ import annotations

from typing import Any

from service.errors import APIError

PREFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
          500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class AnthropicError(APIError):
    """An APIError (status, message, Retry-After and WWW-Authenticate kept) in Anthropic's body."""

    def __init__(self, err: APIError) -> None:
        super().__init__(err.status, err.message, param=err.param, code=err.code,
                         type=_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error"),
                         retry_after_s=err.retry_after_s)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def anthropic_error(err: APIError) -> AnthropicError:
    return err if isinstance(err, AnthropicError) else AnthropicError(err)


def for_path(path: str, err: APIError) -> APIError:
    """`err` as the clients of `path` read it: Anthropic's shape on the Messages routes."""
    return anthropic_error(err) if is_messages_path(path) else err
