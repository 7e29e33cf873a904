"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, so the official
`anthropic` client works against `tieredkv serve` unchanged (base_url = the server).

Knows: the order a request goes through, as /v1/chat/completions's (service/openai_routes.py):
authenticate (401; `x-api-key` or `Authorization: Bearer`, the same keys and tenants), parse the
body (415/413/400: service/messages_schemas.py), resolve the tenant (metadata.user_id, as OpenAI's
`user`), check the model (404), build SamplingParams (400), bound the prompt's size before it is
tokenized (400), admit (429/503), then on a worker thread template the conversation exactly as
chat does (so greedy text equals chat's for the same conversation), place its cache_control
breakpoints (service/messages_usage.py) and check max_tokens against the context (400), and run
the engine: answered in one message, or streamed (service/messages_stream.py). A client gone or a
request past its timeout aborts the engine's request, billed for what was sent. Every error is in
Anthropic's shape (service/messages_errors.py). The message id (`msg_<hex>`) is the engine's
request id: the body's, `request-id`'s and `x-request-id`'s, the log line's and the ledger's.
count_tokens answers `{"input_tokens": N}`: the prompt /v1/messages would run, through the template.
Doesn't know: the JSON of a response (service/messages_responses.py), or the OpenAI routes.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from engine.abort import AbortHandle
from service.body_parsing import parse_body
from service.context import AppContext, ctx
from service.disconnect import until_disconnected
from service.dispatch import Abandoned
from service.errors import from_engine_error
from service.messages_responses import message_body, stop_fields
from service.messages_schemas import Conversation, CountTokensRequest, MessagesRequest
from service.messages_stream import stream_message
from service.messages_usage import TemplatedPrompt, usage_body

router = APIRouter()
ID_PREFIX = "msg_"           # the engine's request ids for this route: msg_<hex>, Anthropic's form


def _conversation_checked(c: AppContext, req: CountTokensRequest | MessagesRequest) -> Conversation:
    """The request's conversation, once its text is known to be small enough to tokenize (400)."""
    conversation = req.conversation()
    c.check_prompt_size(messages=conversation.messages)      # before anything tokenizes it
    return conversation


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request, x_api_key=True)
    req = await parse_body(request, MessagesRequest)
    tenant = c.caller(request, req.user_id, x_api_key=True, user_field="metadata.user_id").tenant
    c.check_model(req.model)
    try:
        params = req.sampling_params()
    except ValueError as e:
        raise from_engine_error(e) from None
    engine = c.engine
    prompt = TemplatedPrompt(engine, _conversation_checked(c, req))
    abort = AbortHandle()      # aborts the engine's request when its client goes or it times out

    def prompt_ids() -> list[int]:    # on the worker thread: templating and placing breakpoints is real work
        return c.with_room(prompt.ids(), req.max_tokens)

    # Each breakpoint's segment retained under its ttl (placed by prompt_ids(): evaluated first).
    if req.stream:
        return await stream_message(c, request, lambda: engine.stream(prompt_ids(), params, tenant=tenant, abort=abort,
                                                                      id_prefix=ID_PREFIX, retain=prompt.spans()),
                                    tenant, abort, prompt)

    def run() -> Any:
        return engine.generate(prompt_ids(), params, tenant=tenant, abort=abort, id_prefix=ID_PREFIX,
                               retain=prompt.spans())
    try:
        out = await c.dispatcher.call(run, tenant=tenant, timeout=c.settings.request_timeout_s, abort=abort,
                                      gone=lambda: until_disconnected(request))
    except Abandoned as gone:
        return c.abandoned(request, gone, gone.result, gone.result.request_id if gone.result is not None else None)
    rid = out.request_id
    c.finished(request, rid, out.usage, out.metrics, out.finish_reason)
    body = message_body(rid, c.model_name, out.text, stop_fields(out.finish_reason, out.stop_string),
                        usage_body(out.usage, prompt.marks))
    return JSONResponse(body, headers={"x-request-id": rid, "request-id": rid})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Any:
    c = ctx(request)
    c.authenticate(request, x_api_key=True)
    req = await parse_body(request, CountTokensRequest)
    c.caller(request, x_api_key=True)
    c.check_model(req.model)
    messages = _conversation_checked(c, req).dicts()
    try:
        ids = await run_in_threadpool(c.engine.apply_chat_template, messages)
    except Exception as e:
        raise from_engine_error(e) from None
    return {"input_tokens": len(ids)}
