"""A request's body read under a size limit, for the service and the router alike.

Knows: the two checks -- the declared Content-Length first, then the bytes counted as they
stream in -- so a body past the limit is never buffered; and that a body the connection itself
refused (too slow, a chunk too large: service/read_limits.py) reaches the app as a disconnect,
raised here as what the client was answered. Doesn't know: what a refusal over the limit looks
like (the service raises its 413 error, the router answers its own).
"""
from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from service.read_limits import refusal


async def read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes. A body the connection refused: that
    refusal (an APIError, already answered); a client that left: ClientDisconnect."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    try:
        return await read_bounded(request.stream(), limit)
    except ClientDisconnect:
        refused = refusal(request.scope)
        if refused is not None:
            raise refused from None
        raise


async def read_bounded(chunks: AsyncIterator[bytes], limit: int) -> bytes | None:
    """The chunks joined, or None once they pass `limit` bytes (the rest left unread)."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)
