"""A streamed /v1/messages request: the engine's chunks as Anthropic's server-sent events.

Knows: the order of a stream's life, as /v1/chat/completions streams (service/openai_routes.py)
-- its first chunk awaited before the response starts (an error up front gets its real HTTP
status, in Anthropic's shape), then message_start with the prompt's usage (from the first chunk's
hits: service/messages_usage.py), a text delta per chunk with text, and at the end the stop
reason and the whole usage (the engine billed it before handing over the last chunk). An error
after the start is a last `event: error`. A client gone mid-stream aborts the engine's request
(engine/abort.py), billed for the tokens whose events were sent; its log line says why.
Doesn't know: the request's schema, or the response's JSON (service/messages_responses.py).
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import Request

from engine.abort import CLIENT_DISCONNECTED, TIMEOUT, AbortHandle
from service.context import AppContext
from service.disconnect import ClosingStreamingResponse
from service.engine_stream import TokenGaps, first_chunk, timed
from service.errors import APIError
from service.messages_responses import MessageEvents, stop_fields
from service.messages_usage import TemplatedPrompt, usage_body
from service.request_log import record


async def stream_message(c: AppContext, request: Request, chunks: Callable[[], Iterator[Any]], tenant: str,
                         abort: AbortHandle, prompt: TemplatedPrompt) -> ClosingStreamingResponse:
    """`chunks()` (run on the request's worker thread: it templates the prompt, then streams the
    engine's chunks) as Anthropic's events. `abort`: the handle the engine's request holds."""
    gaps = TokenGaps()
    events = await c.dispatcher.stream(lambda: timed(c, chunks(), gaps), tenant=tenant,
                                       timeout=c.settings.request_timeout_s)
    first = await first_chunk(c, request, events, abort)      # errors before it raise here: real statuses
    rid = first.request_id          # "msg_<hex>": the body's id, the headers', the log line's and the ledger's
    record(request).request_id = rid
    writer = MessageEvents(rid, c.model_name)

    async def body() -> AsyncIterator[bytes]:
        # NOTE abort: as the OpenAI streams (service/openai_routes.py): the engine's request ends
        # within a step of the client leaving, billed for the tokens whose events were sent (a
        # chunk counts once its yield returns).
        sent, ended = 0, False
        try:
            opening = first.usage if first.finish_reason is not None else prompt.usage_before(
                first.hit_tokens_by_tier or {})
            yield writer.start(usage_body(opening, prompt.marks, output_tokens=0))
            chunk = first
            while chunk is not None:
                if chunk.text:
                    yield writer.text(chunk.text)
                if chunk.finish_reason is not None:
                    ended = True          # finished and billed by the engine
                    c.finished(request, rid, chunk.usage, chunk.metrics, chunk.finish_reason, gaps.intervals)
                    yield writer.stop(stop_fields(chunk.finish_reason, chunk.stop_string),
                                      usage_body(chunk.usage, prompt.marks))
                    break
                sent += len(chunk.token_ids)
                chunk = await anext(events, None)
        except APIError as e:
            ended = True             # failed in the engine, or aborted here (504)
            if e.status == 504 and abort.abort(TIMEOUT, sent):
                record(request).reason = f"after the stream started: {e.message}; aborted after {sent} tokens"
            else:
                record(request).reason = f"after the stream started: {e.message}"
            yield writer.error(e)
        finally:
            if not ended:                # the client left mid-stream (service/disconnect.py)
                c.client_gone(request.scope, "streaming")
                if abort.abort(CLIENT_DISCONNECTED, sent):
                    record(request).reason = f"the client disconnected after {sent} output tokens; aborted"

    return ClosingStreamingResponse(body(), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                             "x-request-id": rid, "request-id": rid})
