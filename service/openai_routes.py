"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Knows: the order every generation request goes through -- authenticate (401), parse the
body (415/413/400), resolve the tenant, check the model (404), build SamplingParams (400), bound
the prompt's size before it is tokenized (400), admit (429/503), run the engine call off the
event loop -- and how engine output becomes a JSON response or an SSE stream. A stream's first chunk is awaited before the response starts, so
errors the engine raises up front (bad prompt, queue full, closed) get their real HTTP status;
an error after that is sent as a last `data: {"error": ...}` event.
The engine bills a request before it returns its last output, so a response (or a stream's
final chunk) is only sent after the request is durable in the ledger. A client that disconnects
(awaiting its response, its stream's first chunk, or mid-stream) or a request past its timeout
aborts the engine's request (engine/abort.py): it is billed for the prompt as served and the
completion tokens sent, and its log line says why.
Doesn't know: the cache routes, auth's keys file, or metric names.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.abort import CLIENT_DISCONNECTED, TIMEOUT, AbortHandle
from engine.request_intake import is_batch   # the engine's rule: the route and the engine split a batch alike
from engine.retain_spans import RetainSpan
from engine.sampling_params import SamplingParams
from service.context import AppContext, ctx
from service.disconnect import ClosingStreamingResponse, until_disconnected
from service.dispatch import Abandoned
from service.engine_stream import TokenGaps, delivered, first_chunk, timed
from service.errors import APIError, from_engine_error
from service.request_log import record
from service.batch_prompts import UsageByRequest, as_one, flatten
from service.responses import SSE_DONE, ChunkWriter, Logprobs, chat_body, completion_body, completion_id, sse
from service.body_parsing import parse_body
from service.schemas import ChatRequest, CompletionRequest

router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request)
    req = await parse_body(request, CompletionRequest)
    record(request).cache_key = req.prompt_cache_key
    caller = c.caller(request, req.user)
    c.check_model(req.model)
    params = _params(req, COMPLETIONS_DEFAULT_MAX_TOKENS)
    engine, tenant, prompt = c.engine, caller.tenant, req.prompt
    # A batch (service/prompt_field.py): each prompt its own engine request, billed on its own; one
    # response with every prompt's choices, index = prompt_index * n + choice (service/batch_prompts.py).
    batch = is_batch(prompt)
    prompts = prompt if batch else [prompt]
    for one in prompts:
        c.check_prompt_size(prompt=one)      # before anything tokenizes it
    logprobs = _logprobs(engine, req, chat=False)

    def prompt_ids() -> Any:   # on a worker thread: tokenizing a long prompt is real work
        ids = [c.with_room(engine.encode(p), req.requested_max_tokens) for p in prompts]
        return ids if batch else ids[0]
    return await _generate(c, request, req, prompt_ids, params, tenant, logprobs, chat=False,
                           prompts=len(prompts) if batch else None)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request)
    req = await parse_body(request, ChatRequest)
    record(request).cache_key = req.prompt_cache_key
    caller = c.caller(request, req.user)
    c.check_model(req.model)
    params = _params(req, c.settings.default_chat_max_tokens)
    c.check_prompt_size(messages=req.messages)
    engine, tenant = c.engine, caller.tenant
    messages = [m.to_dict() for m in req.messages]
    logprobs = _logprobs(engine, req, chat=True)

    def prompt_ids() -> list[int]:
        return c.with_room(engine.apply_chat_template(messages), req.requested_max_tokens)
    # Streaming and non-streaming chat both run the template and then generate/stream, so the
    # two see the same prompt ids and give the same greedy text.
    return await _generate(c, request, req, prompt_ids, params, tenant, logprobs, chat=True)


async def _generate(c: AppContext, request: Request, req: Any, prompt_ids: Callable[[], Any],
                    params: SamplingParams, tenant: str, logprobs: Any, chat: bool, prompts: int | None = None) -> Any:
    """The request run: streamed as SSE, or generated off the event loop and answered in one body.
    `prompt_ids` runs on the worker thread (tokenizing a long prompt is real work). `prompts`: the
    size of a batch of prompts (their ids a list of lists), None for one prompt."""
    engine = c.engine
    prefix = "chatcmpl" if chat else "cmpl"     # the engine's id is the body's: the ledger's key too
    # OpenAI's prompt_cache_retention "24h": the whole prompt kept a day (engine/retain_spans.py).
    retain = (RetainSpan(None, "24h"),) if req.prompt_cache_retention == "24h" else ()
    choices = params.n * (prompts or 1)
    abort = AbortHandle()      # aborts the engine's request when its client goes or it times out
    if req.stream:
        gaps = TokenGaps()
        return await _stream(c, request, lambda: timed(c, engine.stream(prompt_ids(), params, tenant=tenant,
                                                                        abort=abort, id_prefix=prefix,
                                                                        retain=retain), gaps),
                             tenant, abort, chat=chat, include_usage=req.include_usage, logprobs=logprobs, gaps=gaps,
                             n=choices)

    def run() -> Any:
        out = engine.generate(prompt_ids(), params, tenant=tenant, abort=abort, id_prefix=prefix, retain=retain)
        return _with_logprobs(flatten(out, params.n) if prompts is not None else out, logprobs)
    try:
        out, lp = await c.dispatcher.call(run, tenant=tenant, timeout=c.settings.request_timeout_s, abort=abort,
                                          gone=lambda: until_disconnected(request))
    except Abandoned as gone:
        out = _one(gone.result[0]) if gone.result is not None else None
        return c.abandoned(request, gone, out, completion_id(out.request_id, chat) if out is not None else None)
    # NOTE: one id per request: the body's `id`, x-request-id and the log line's id are the same string.
    first = _first(out)         # n > 1 or a batch: a list of the choices, each carrying the response's usage
    rid = completion_id(first.request_id, chat)
    c.finished(request, rid, first.usage, first.metrics, first.finish_reason)
    body = chat_body if chat else completion_body
    return JSONResponse(body(out, c.model_name, int(time.time()), lp), headers={"x-request-id": rid})


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, list) else out


def _one(out: Any) -> Any:
    """An abandoned request's output as its log line counts it (n > 1 or a batch: batch_prompts.as_one)."""
    return as_one(out) if isinstance(out, list) else out


@router.get("/v1/models")
async def list_models(request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request)
    return {"object": "list", "data": [_model_card(c)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request)
    c.check_model(model_id)
    return _model_card(c)


def _model_card(c: AppContext) -> dict[str, Any]:
    return {"id": c.model_name, "object": "model", "created": c.started, "owned_by": "tieredkv",
            "max_model_len": c.engine.max_context}


def _logprobs(engine: Any, req: Any, chat: bool) -> Logprobs | None:
    n = req.top_logprobs_n
    return None if n is None else Logprobs(engine.tokenizer, n, chat=chat)


def _with_logprobs(out: Any, logprobs: Logprobs | None) -> tuple[Any, Any]:
    """The output and its logprobs object (n > 1: one per choice, each its own text offsets),
    built on the worker thread (it decodes every token)."""
    if logprobs is None:
        return out, None
    if isinstance(out, list):
        return out, [logprobs.fresh().of(o) for o in out]
    return out, logprobs.of(out)


def _params(req: Any, default_max_tokens: int) -> Any:
    """The request's SamplingParams (one without a seed is seeded by the engine: Engine(seed=...))."""
    try:
        return req.sampling_params(default_max_tokens)
    except ValueError as e:
        raise from_engine_error(e) from None


async def _stream(c: AppContext, request: Request, make_iter: Any, tenant: str, abort: AbortHandle, chat: bool,
                  include_usage: bool, logprobs: Logprobs | None, gaps: TokenGaps,
                  n: int = 1) -> StreamingResponse:
    events = await c.dispatcher.stream(make_iter, tenant=tenant, timeout=c.settings.request_timeout_s)
    first = await first_chunk(c, request, events, abort)     # errors before it raise here: real statuses
    rid = completion_id(first.request_id, chat)
    record(request).request_id = rid
    writer = ChunkWriter(first.request_id, c.model_name, int(time.time()), chat=chat, include_usage=include_usage)

    async def body() -> AsyncIterator[bytes]:
        # NOTE abort: the engine's request ends within a step of the client leaving (this
        # generator is then closed at a yield, or cancelled while it awaits a chunk), billed for
        # the completion tokens whose chunks were sent; a chunk counts once its yield returns.
        # n > 1: the choices' chunks come interleaved, each with its index (as OpenAI's); the
        # stream ends once every choice has finished, with the request's usage (billed once).
        # A batch of prompts: n is every prompt's choices, indexed prompt-major; its usage the
        # prompts' summed. An abort bills each choice for the tokens of its chunks sent (`sent`).
        sent, ended, done, usages = [0] * n, False, set(), UsageByRequest()
        lps = {i: logprobs if i == 0 else logprobs.fresh() for i in range(n)} if logprobs is not None else {}
        try:
            if chat:
                for i in range(n):
                    yield writer.role(i)
            chunk = first
            while chunk is not None:
                i = chunk.index
                lp = None if logprobs is None else lps[i].of(chunk)
                if chunk.finish_reason is not None:
                    done.add(i)
                    usages.add(chunk)
                    if chat and chunk.text:
                        yield writer.text(chunk.text, logprobs=lp, index=i)
                        yield writer.text("", chunk.finish_reason, index=i)
                    else:
                        yield writer.text(chunk.text, chunk.finish_reason, lp, index=i)
                    if len(done) == n:
                        ended = True         # finished and billed by the engine
                        usage = usages.total()
                        c.finished(request, rid, usage, chunk.metrics, chunk.finish_reason, gaps.intervals)
                        if include_usage and usage is not None:
                            yield writer.usage(usage)
                        break
                elif chunk.text or lp:
                    yield writer.text(chunk.text, logprobs=lp, index=i)
                sent[i] += len(chunk.token_ids)
                chunk = await anext(events, None)
        except APIError as e:
            ended = True             # failed in the engine, or aborted here (504)
            if e.status == 504 and abort.abort(TIMEOUT, delivered(sent)):
                record(request).reason = f"after the stream started: {e.message}; aborted after {sum(sent)} tokens"
            else:
                record(request).reason = f"after the stream started: {e.message}"
            yield sse(e.body())
            return
        finally:
            if not ended:                # the client left mid-stream (service/disconnect.py)
                c.client_gone(request.scope, "streaming")
                if abort.abort(CLIENT_DISCONNECTED, delivered(sent)):
                    record(request).reason = f"the client disconnected after {sum(sent)} completion tokens; aborted"
        yield SSE_DONE

    return ClosingStreamingResponse(body(), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                             "x-request-id": rid})
