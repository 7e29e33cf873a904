"""How a request's body becomes one of service/schemas.py's models, or an OpenAI-style error.

Knows: a body must be sent as application/json (415 otherwise; an empty body where one is
optional needs no type), is at most `max_body_bytes` (413 past it, counted while it streams in:
service/request_body.py), its JSON at most as deep as Python's parser goes (400 past it), and its
strings and keys valid Unicode (a lone surrogate such as "\ud800" is a 400 naming the field,
escaped); a field of the wrong type is a 400 naming it; an unknown field is OpenAI's
"Unrecognized request argument supplied" 400, or, with ServiceSettings(unknown_fields="ignore"),
dropped, logged once per name and named in the X-Tieredkv-Ignored-Fields header. The router
parses with `decode_json_object` too (it must refuse what a backend refuses, the same way).
Doesn't know: the models' fields (service/schemas.py), tenants or the engine.
"""
from __future__ import annotations

import json
import logging
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from service.disconnect import ClientGone
from service.errors import APIError, bad_request, param_of, validation_error
from service.request_body import read_limited

log = logging.getLogger("tieredkv.service")

DEFAULT_MAX_BODY_BYTES = 8 << 20
IGNORED_HEADER = "X-Tieredkv-Ignored-Fields"
M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 once it passes the limit: checked against Content-Length
    first, then counted as it streams in, so a 200 MB body is never buffered. A client that
closes the connection before it has sent the whole body is ClientGone (a 499)."""
    limit = getattr(request.app.state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    try:
        body = await read_limited(request, limit)
    except ClientDisconnect:       # a client's event, not a server error (service/disconnect.py)
        raise ClientGone("body", "the client disconnected before its body was read") from None
    if body is None:
        raise APIError(413, f"request body: larger than the server's limit of {limit} bytes",
                       code="request_too_large")
    return body


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def shown_name(name: str) -> str:
    """A key as an error may show it: itself when it is valid Unicode, else its escaped repr
    (ascii()), so a lone surrogate never reaches a response body or a log line."""
    return name if _encodable(name) else ascii(name)


def _bad_string(data: Any) -> str | None:
    """The path of the first string or object key that is not valid Unicode (a lone surrogate),
    or None. The path shows such a key escaped. Iterative: the parsed JSON may be nested as deep
    as the parser allowed."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "request body"
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{shown_name(k)}" if path else shown_name(k)
                if not _encodable(k):
                    return sub
                stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def is_json_media_type(content_type: str | None) -> bool:
    """application/json (any parameters, such as charset=utf-8), or a structured +json type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _unsupported_media_type(content_type: str | None) -> APIError:
    got = "none" if not content_type else repr(content_type[:100])
    return APIError(415, f"Content-Type must be application/json (got {got})", code="unsupported_media_type")


def _short(name: str, limit: int = 200) -> str:
    return name if len(name) <= limit else name[:limit] + "..."


def unrecognized(name: str) -> APIError:
    """OpenAI's answer to a field it does not know, in its words."""
    return bad_request(f"Unrecognized request argument supplied: {_short(name)}", param=_short(name))


def _drop(data: dict, loc: tuple) -> None:
    """Remove the value at a pydantic error location from the parsed body."""
    parent: Any = data
    for part in loc[:-1]:
        parent = parent[part]
    if isinstance(parent, dict):
        parent.pop(loc[-1], None)


MAX_LOGGED_IGNORED = 1000     # field names remembered for "logged once"; past it, no more warnings


def _note_ignored(request: Request, names: list[str]) -> None:
    """Lenient mode: the names go into the response header (service.app adds it) and each new
    one is logged once at WARNING."""
    state = request.app.state
    logged: set[str] = getattr(state, "ignored_fields_logged", None) or set()
    state.ignored_fields_logged = logged
    for name in names:
        if name not in logged and len(logged) < MAX_LOGGED_IGNORED:
            logged.add(name)
            log.warning("ignoring the unrecognized request field %s (%s %s); it is not honoured",
                        ascii(_short(name)), request.method, request.url.path)
    request.state.ignored_fields = list(dict.fromkeys(getattr(request.state, "ignored_fields", []) + names))


def ignored_header_value(names: list[str]) -> str:
    """The header's value: each name percent-encoded where it is not a plain identifier path
    (so a comma or a non-ASCII letter cannot break the list), at most 32 names of 100 chars."""
    shown = [quote(_short(n, 100), safe="._-[]") for n in names[:32]]
    return ",".join(shown + (["..."] if len(names) > 32 else []))


def check_json_content_type(content_type: str | None) -> None:
    """APIError 415 unless `content_type` is JSON's (what a generation route requires)."""
    if not is_json_media_type(content_type):
        raise _unsupported_media_type(content_type)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """A body's bytes as a JSON object, or APIError 400: malformed JSON or invalid UTF-8, nesting
    past the parser's depth, an integer past Python's digit limit, a body that is not an object,
    or a string or key that is not valid Unicode. The service and the router (which must refuse
    what a backend refuses, the same way) both parse with this."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from None
    except ValueError as e:
        # JSONDecodeError, UnicodeDecodeError, and the ValueError of an integer longer than
        # sys.get_int_max_str_digits() (4300 digits).
        raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body: expected a JSON object")
    bad = _bad_string(data)
    if bad is not None:
        raise bad_request(f"{bad}: not valid Unicode (a lone surrogate such as \\ud800)", param=bad)
    return data


async def parse_body(request: Request, model: type[M], *, empty_ok: bool = False) -> M:
    """The request's JSON body as `model`; APIError 415 when it is not sent as JSON, 400 for
    malformed JSON, a body that is not an object, any field of the wrong type (the message names
    the field) or an unknown field (unless the app ignores them); 413 past the size limit."""
    content_type = request.headers.get("content-type")
    json_type = is_json_media_type(content_type)
    if not json_type and not empty_ok:
        raise _unsupported_media_type(content_type)
    raw = await read_body(request)
    if not raw.strip() and empty_ok:
        data: dict[str, Any] = {}
    else:
        if not json_type:
            raise _unsupported_media_type(content_type)
        data = decode_json_object(raw)
    lenient = getattr(request.app.state, "unknown_fields", "reject") == "ignore"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = list(e.errors())
    unknown = [err for err in errors if err.get("type") == "extra_forbidden"]
    if not unknown:
        raise validation_error(errors)
    if not lenient:
        raise unrecognized(param_of(tuple(unknown[0]["loc"])))
    # Lenient: drop every unknown field (deepest first, so a list index stays valid) and retry.
    for err in sorted(unknown, key=lambda err: len(err["loc"]), reverse=True):
        _drop(data, tuple(err["loc"]))
    _note_ignored(request, [param_of(tuple(err["loc"])) for err in unknown])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
