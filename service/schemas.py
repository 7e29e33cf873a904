"""Request bodies the service accepts, as strict pydantic models, and how a body is parsed.

Knows: OpenAI's request shapes for /v1/completions and /v1/chat/completions (single choice,
text or token-id prompts), the cache routes' bodies, and OpenAI's defaults (temperature 1,
top_p 1, completions max_tokens 16). Types are strict: "5" is not an int and 1 is not a
string. Unknown fields are ignored, as vLLM does; known OpenAI fields this server cannot
honour are refused with a 400 naming the field rather than silently ignored, so a user never
believes they got something they did not: n > 1, penalties, logit_bias, echo, best_of > 1,
suffix, tools / tool_choice / parallel_tool_calls / functions, response_format other than
text, modalities other than text, audio, prediction, a message's name, stream_options without
stream, chat top_logprobs without logprobs. Log-probabilities are honoured: completions
`logprobs` (0-20) and chat `logprobs` / `top_logprobs` (0-20). A body is at most
`max_body_bytes` (413 past it, counted while it streams in), its JSON at most as deep as
Python's parser goes (400 past it), and its strings valid Unicode (a lone surrogate such as
"\ud800" is a 400 naming the field).
Doesn't know: tenants or the engine.
"""
from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from engine.sampling_params import SamplingParams
from service.errors import APIError, bad_request, validation_error

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_LOGPROBS = 20          # top log-probabilities per token, as OpenAI's chat and vLLM's default

_STRICT = ConfigDict(strict=True, extra="ignore")
M = TypeVar("M", bound=BaseModel)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return v
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise ValueError("batched prompts are not supported; send one prompt (a string or a list of token ids)")
    raise ValueError("expected a string or a list of integer token ids")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False


def _top_n(v: int | None) -> int | None:
    if v is not None and not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"expected an int in [0, {MAX_LOGPROBS}], got {v}")
    return v


def _refuse(v: Any) -> Any:
    """For fields this server cannot honour: any value but null is a 400 naming the field."""
    if v is not None:
        raise ValueError("not supported by this server")
    return v


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: Any = None           # refused: the chat template has no place for a participant's name

    @field_validator("name", mode="before")
    @classmethod
    def _no_name(cls, v: Any) -> Any:
        return _refuse(v)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> str:
        # OpenAI's content is a string or a list of parts; only text parts mean anything here.
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError("expected a string or a list of {\"type\": \"text\", \"text\": ...} parts")

    def to_dict(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class _GenerationRequest(BaseModel):
    """The fields completions and chat share."""
    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                 # extension (vLLM's): 0 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool | None = None           # extension (vLLM's)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("expected a string or a list of strings")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError(f"penalties are not supported (only 0), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def model_post_init(self, _: Any) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_n(self) -> int | None:
        """How many top log-probabilities per token the response carries; None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; its own checks raise ValueError naming the field."""
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=self.stop or (),
            ignore_eos=bool(self.ignore_eos),
            # The engine returns the sampled token's log-probability with any top n >= 1.
            logprobs=0 if self.top_logprobs_n is None else max(self.top_logprobs_n, 1))


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        return check_prompt(v)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        return _top_n(v)           # 0: only the sampled token's log-probability

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator("tools", "functions", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v not in (None, []):
            raise ValueError("tool and function calling are not supported by this server")
        return v

    @field_validator("tool_choice", "function_call", mode="before")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none"):
            raise ValueError("tool and function calling are not supported by this server")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _text_format(cls, v: Any) -> Any:
        if v is not None and v != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported (no JSON mode or JSON schema)')
        return v

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is not None and v != ["text"]:
            raise ValueError('only ["text"] is supported')
        return v

    @field_validator("parallel_tool_calls", "audio", "prediction", mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        return _refuse(v)

    @field_validator("messages")
    @classmethod
    def _some(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("expected at least one message")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return _top_n(v)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: only allowed when logprobs is true", param="top_logprobs")

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LookupRequest(BaseModel):
    """What the cache holds for a prompt (text or token ids) or a chat's messages."""
    model_config = _STRICT
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int] | None:
        return None if v is None else check_prompt(v)

    def model_post_init(self, _: Any) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt, messages: give exactly one of them", param="prompt")
        if self.messages is not None and not self.messages:
            raise bad_request("messages: expected at least one message", param="messages")


class FlushRequest(BaseModel):
    model_config = _STRICT
    tier: Literal["device", "host", "disk"] | None = None


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 once it passes the limit: checked against Content-Length
    first, then counted as it streams in, so a 200 MB body is never buffered."""
    limit = getattr(request.app.state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    too_big = APIError(413, f"request body: larger than the server's limit of {limit} bytes",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _bad_string(data: Any) -> str | None:
    """The path of the first string that is not valid Unicode (a lone surrogate), or None.
    Iterative: the parsed JSON may be nested as deep as the parser allowed."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "request body"
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


async def parse_body(request: Request, model: type[M], *, empty_ok: bool = False) -> M:
    """The request's JSON body as `model`; APIError 400 for malformed JSON, a body that is not
    an object, or any field of the wrong type (the message names the field); 413 past the size
    limit."""
    raw = await read_body(request)
    if not raw.strip() and empty_ok:
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from None
        except RecursionError:
            raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body: expected a JSON object")
    bad = _bad_string(data)
    if bad is not None:
        raise bad_request(f"{bad}: not valid Unicode (a lone surrogate such as \\ud800)", param=bad)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
