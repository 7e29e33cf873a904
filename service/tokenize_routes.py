"""vLLM's tokenizer routes: /tokenize and /detokenize, with vLLM's shapes.

    POST /tokenize   {"model"?, "prompt": str, "add_special_tokens"?} or
                     {"model"?, "messages": [...], "add_generation_prompt"?, "add_special_tokens"?},
                     either with "return_token_strs"?
                     -> {"tokens": [...], "count": n, "max_model_len": m, "token_strs"?: [...]}
    POST /detokenize {"model"?, "tokens": [...]} -> {"prompt": str}

Knows: that a prompt is tokenized as a generation request's is (same tokenizer call, so
`count` is the prompt_tokens a completion would be billed; messages through the chat
template), that a prompt longer than the context is still counted (that is what a client asks
to find out), and the checks every route makes: the API key (401), the model's name when given
(404), the body (400), the prompt's size before it is tokenized (400). Tokenizing runs off the
event loop.
Doesn't know: generation or the cache.
"""
from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from service.context import ctx
from service.errors import bad_request, from_engine_error
from service.body_parsing import parse_body
from service.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()
T = TypeVar("T", TokenizeRequest, DetokenizeRequest)


def _tokenizer(engine: Any) -> Any:
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer; only token-id prompts work with it", code="no_tokenizer")
    return engine.tokenizer


async def _parsed(request: Request, model: type[T]) -> tuple[Any, T]:
    """The app's context and the body, once the caller is authenticated and the model checked."""
    c = ctx(request)
    c.authenticate(request)
    req = await parse_body(request, model)
    c.caller(request)
    if req.model is not None:
        c.check_model(req.model)
    return c, req


@router.post("/tokenize")
async def tokenize(request: Request) -> Any:
    c, req = await _parsed(request, TokenizeRequest)
    c.check_prompt_size(prompt=req.prompt, messages=req.messages)
    engine = c.engine
    tokenizer = _tokenizer(engine)

    def ids() -> list[int]:
        if req.messages is not None:
            return engine.apply_chat_template([m.to_dict() for m in req.messages],
                                              add_generation_prompt=req.add_generation_prompt is not False,
                                              add_special_tokens=bool(req.add_special_tokens))
        return list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens is not False)["input_ids"])
    try:
        tokens = await run_in_threadpool(ids)
    except Exception as e:
        raise from_engine_error(e) from None
    body: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_context}
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return body


@router.post("/detokenize")
async def detokenize(request: Request) -> Any:
    c, req = await _parsed(request, DetokenizeRequest)
    engine = c.engine
    tokenizer = _tokenizer(engine)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < engine.vocab_size:
            raise bad_request(f"tokens[{i}]: token id {t} is outside the vocabulary [0, {engine.vocab_size})",
                              param=f"tokens[{i}]")
    try:
        text = await run_in_threadpool(tokenizer.decode, req.tokens)
    except Exception as e:       # ids the model knows but its tokenizer does not: the input's fault
        raise bad_request(f"tokens: cannot be decoded ({type(e).__name__}: {e})", param="tokens") from None
    return {"prompt": text}
