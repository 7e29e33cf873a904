"""A streamed generation's engine side, as every streaming route runs it (OpenAI's chunks in
service/openai_routes.py, Anthropic's events in service/messages_stream.py).

Knows: a stream's first chunk awaited before its response starts (so errors the engine raises up
front get their real HTTP status), the request aborted when its client leaves meanwhile or the
wait times out; each chunk's arrival timed on the stream's worker thread (inter-token latency) and
an aborted stream's bill counted in the metrics there; an abort's delivered-token count.
Doesn't know: any response's shape.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

from fastapi import Request

from engine.abort import CLIENT_DISCONNECTED, TIMEOUT, AbortHandle
from service.context import AppContext
from service.disconnect import ClientGone, until_disconnected
from service.errors import APIError


def delivered(sent: list[int]) -> int | tuple[int, ...]:
    """An abort's delivered tokens: one request's count, or one per choice (engine/abort.py)."""
    return sent[0] if len(sent) == 1 else tuple(sent)


class TokenGaps:
    """A stream's inter-token intervals, as its chunks came from the engine. Written by the
    stream's worker thread only, before it hands the chunk on; read by the event loop once it
    has the last chunk (handed over after the last write)."""

    def __init__(self) -> None:
        self.intervals: list[float] = []
        self._last: float | None = None

    def chunk(self, tokens: int) -> None:
        now = time.perf_counter()
        if tokens and self._last is not None:
            self.intervals.extend([(now - self._last) / tokens] * tokens)
        if tokens:
            self._last = now


def timed(c: AppContext, chunks: Iterator[Any], gaps: TokenGaps) -> Iterator[Any]:
    """A stream's chunks, on its worker thread: each one's arrival noted (inter-token latency);
    an aborted stream's bill (its last chunk, which nobody reads) is counted in the metrics here,
    as a finished one's is when it is sent: once per engine request (n > 1: its choices' last
    chunks all carry it; a batch: each prompt's request has its own)."""
    counted: set[str] = set()
    for chunk in chunks:
        if getattr(chunk, "index", 0) == 0:   # n > 1: the first choice's gaps (the others interleave)
            gaps.chunk(len(chunk.token_ids))
        if chunk.finish_reason == "abort" and chunk.request_id not in counted:
            counted.add(chunk.request_id)
            c.metrics.observe_request(chunk.usage, None, "abort")
        yield chunk


async def first_chunk(c: AppContext, request: Request, events: Any, abort: AbortHandle) -> Any:
    """A stream's first chunk (it may wait in the queue); the request is aborted when the client
    leaves meanwhile (a 499 nobody reads, for the log) or the wait times out (504)."""
    first = asyncio.ensure_future(anext(events, None))
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if first.done():
        try:
            chunk = first.result()
        except APIError as e:
            if e.status == 504:
                abort.abort(TIMEOUT, 0)
            raise
        if chunk is None:
            raise APIError(500, "the engine's stream ended without output", code="internal_error")
        return chunk
    first.cancel()
    abort.abort(CLIENT_DISCONNECTED, 0)
    raise ClientGone("queued", "the client disconnected before the first chunk; aborted")
