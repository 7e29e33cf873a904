"""Request bodies the service accepts, as strict pydantic models.

Knows: OpenAI's request shapes for /v1/completions and /v1/chat/completions (n choices;
text or token-id prompts, batched on completions: service/prompt_field.py), the cache routes' bodies, vLLM's /tokenize and /detokenize bodies, and OpenAI's defaults (temperature 1,
top_p 1, completions max_tokens 16). Types are strict: "5" is not an int and 1 is not a
string. Nothing is silently ignored (issue 17):
- Honoured on both generation routes: max_tokens / max_completion_tokens (one name for the
  same cap; both given and different is a 400), temperature, top_p, stop, seed, stream,
  stream_options, logprobs (completions: 0-20; chat: logprobs + top_logprobs 0-20),
  frequency_penalty / presence_penalty ([-2, 2], OpenAI's), and vLLM's extensions top_k, min_p,
  repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output, ignore_eos
  (engine/sampling_params.py says what each does). `user` names the tenant on a server without
  keys (a label otherwise); n=1, best_of=1, echo=false, suffix null, logit_bias {}, store=false
  and the like, which ask for nothing, are accepted; n above the server's --max-n is a 400.
- Refused with a 400 naming the field, as a user would otherwise believe they got it:
  best_of > 1, echo, suffix, logit_bias, guided_* / structured_outputs, response_format other
  than text, tools / tool_choice / parallel_tool_calls / functions / function_call, modalities
  other than text, audio, prediction, reasoning_effort, metadata, store=true, service_tier,
  web_search_options, verbosity, a message's name, stream_options without stream, chat
  top_logprobs without logprobs.
- OpenAI's prompt caching fields: `prompt_cache_key` (a string of at most 256 characters) is
  written in the request log line and keeps a key's requests on one backend behind `tieredkv
  route` (service/router/sticky.py); `prompt_cache_retention` "in_memory" is the cache's LRU,
  "24h" keeps the whole prompt a day (engine/retain_spans.py, billed as a cache write), anything
  else is refused.
- Any other field (nested ones too, such as messages[0].foo) is unknown: a 400
  "Unrecognized request argument supplied: <name>" (OpenAI's words) -- unless the server runs
  with ServiceSettings(unknown_fields="ignore") (`tieredkv serve --lenient-fields`, vLLM's
  behaviour): then it is dropped, logged once per name, and named in the response header
  X-Tieredkv-Ignored-Fields.
How a body's bytes become one of these (content type, size, JSON, unknown fields) is
service/body_parsing.py's. Doesn't know: tenants or the engine.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling_params import SamplingParams
from service.errors import bad_request
from service.prompt_field import Prompts, check_prompt, check_prompts


MAX_LOGPROBS = 20          # top log-probabilities per token, as OpenAI's chat and vLLM's default
MAX_CACHE_KEY_CHARS = 256  # prompt_cache_key's length bound

# extra="forbid": an unknown field is an error that parse_body reports (or, in lenient mode, drops:
# service/body_parsing.py).
_STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False


def _top_n(v: int | None) -> int | None:
    if v is not None and not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"expected an int in [0, {MAX_LOGPROBS}], got {v}")
    return v


# A field this server refuses unless null: documented as such in /openapi.json (service/openapi.py),
# so clients and fuzzers see what is accepted; the validators below refuse any other value.
REFUSED = Field(default=None, json_schema_extra={"type": "null", "description": "not supported by this server"})


def _refuse(v: Any) -> Any:
    """For fields this server cannot honour: any value but null is a 400 naming the field."""
    if v is not None:
        raise ValueError("not supported by this server")
    return v


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: Any = REFUSED           # refused: the chat template has no place for a participant's name

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


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "guided_whitespace_pattern", "structured_outputs")


class _GenerationRequest(BaseModel):
    """The fields completions and chat share."""
    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens
    temperature: float | None = Field(default=None, ge=0, le=2)   # OpenAI's range (the Python API allows more)
    top_p: float | None = None
    top_k: int | None = None                 # extension (vLLM's): 0 = off
    min_p: float | None = None               # extension (vLLM's): 0 = off
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM's)
    include_stop_str_in_output: bool | None = None   # extension (vLLM's)
    min_tokens: int | None = None            # extension (vLLM's)
    repetition_penalty: float | None = None  # extension (vLLM's): 1 = off
    seed: int | None = None
    user: str | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool | None = None           # extension (vLLM's)
    prompt_cache_key: str | None = None      # OpenAI's: logged; the router keeps a key on one backend
    prompt_cache_retention: str | None = None    # OpenAI's: "in_memory" (the cache's LRU) or "24h" (kept a day)
    # Refused (any value but null): constrained decoding is not implemented.
    guided_json: Any = REFUSED
    guided_regex: Any = REFUSED
    guided_choice: Any = REFUSED
    guided_grammar: Any = REFUSED
    guided_decoding_backend: Any = REFUSED
    guided_whitespace_pattern: Any = REFUSED
    structured_outputs: Any = REFUSED

    @field_validator(*_GUIDED, mode="before")
    @classmethod
    def _no_guided(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("guided (constrained) decoding is not supported by this server")
        return v

    @field_validator("prompt_cache_key")
    @classmethod
    def _cache_key(cls, v: str | None) -> str | None:
        if v is not None and not 0 < len(v) <= MAX_CACHE_KEY_CHARS:
            raise ValueError(f"expected a string of 1 to {MAX_CACHE_KEY_CHARS} characters, got {len(v)}")
        return v

    @field_validator("prompt_cache_retention")
    @classmethod
    def _retention(cls, v: str | None) -> str | None:
        if v not in (None, "in_memory", "24h"):
            raise ValueError(f'expected "in_memory" or "24h", got {v!r}')
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("expected a string or a list of strings")

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        # The server's bound (--max-n) is the engine's: above it, a 400 naming n.
        if v is not None and v < 1:
            raise ValueError(f"expected an int >= 1, got {v}")
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
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise bad_request(f"max_completion_tokens: {self.max_completion_tokens} differs from max_tokens "
                              f"{self.max_tokens} (two names for one cap); give one of them",
                              param="max_completion_tokens")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_n(self) -> int | None:
        """How many top log-probabilities per token the response carries; None: no logprobs."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; its own checks raise ValueError naming the field."""
        max_tokens = self.requested_max_tokens
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            # The engine returns the sampled token's log-probability with any top n >= 1.
            logprobs=0 if self.top_logprobs_n is None else max(self.top_logprobs_n, 1),
            n=1 if self.n is None else self.n)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]      # one prompt, or a batch (service/prompt_field.py)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Prompts:
        return check_prompts(v)

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
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = REFUSED
    function_call: Any = REFUSED
    response_format: Any = None
    modalities: Any = None
    audio: Any = REFUSED
    prediction: Any = REFUSED
    reasoning_effort: Any = REFUSED
    metadata: Any = REFUSED
    store: bool | None = None
    service_tier: Any = REFUSED
    web_search_options: Any = REFUSED
    verbosity: Any = REFUSED

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

    @field_validator("parallel_tool_calls", "audio", "prediction", "reasoning_effort", "metadata", "service_tier",
                     "web_search_options", "verbosity", mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        return _refuse(v)

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("storing completions is not supported by this server (only false)")
        return v

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
        _one_of_prompt_or_messages(self.prompt, self.messages)


def _one_of_prompt_or_messages(prompt: Any, messages: list | None) -> None:
    """A body that takes a prompt or a chat's messages has exactly one of them."""
    if (prompt is None) == (messages is None):
        raise bad_request("prompt, messages: give exactly one of them", param="prompt")
    if messages is not None and not messages:
        raise bad_request("messages: expected at least one message", param="messages")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or a chat's messages (with the chat template applied), with
    vLLM's fields and defaults: `add_special_tokens` (a prompt: true, as the engine tokenizes one;
    messages: false, the template writes them), `add_generation_prompt` (messages only, default
    true, as a chat request's prompt is), `return_token_strs` (the tokens' strings too)."""
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool = False

    def model_post_init(self, _: Any) -> None:
        _one_of_prompt_or_messages(self.prompt, self.messages)
        if self.messages is None and self.add_generation_prompt is not None:
            raise bad_request("add_generation_prompt: applies to messages only, not to a prompt",
                              param="add_generation_prompt")


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class FlushRequest(BaseModel):
    model_config = _STRICT
    tier: Literal["device", "host", "disk"] | None = None
