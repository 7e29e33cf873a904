"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as strict
pydantic models, and the conversation they carry in the chat template's terms.

Knows: Anthropic's shapes and defaults (temperature 1, top_p 1, no top_k; `max_tokens`
required), and what is honoured: `model`, `max_tokens`, `system` (a string or a list of text
blocks), `messages` (roles user/assistant; content a string or a list of text blocks; the last
one the user's), `stop_sequences`, `stream`, `temperature` ([0, 1], Anthropic's range), `top_p`,
`top_k` (0: off), `metadata.user_id` (the tenant on a server without keys, as OpenAI's `user`
is), and `cache_control` (`{"type": "ephemeral", "ttl"?: "5m" | "1h"}`) on system and message text
blocks and once at the top level (Anthropic's automatic caching: a breakpoint on the last
block). At most MAX_BREAKPOINTS breakpoints, and a 1h one never after a 5m one (Anthropic's
rules, 400 otherwise). Nothing is ignored: image, document, tool_use, tool_result and thinking
blocks, `tools`, `tool_choice` (but {"type": "none"}), `thinking` (but {"type": "disabled"}),
service_tier, container and the rest are 400s naming the field; an unknown field is the
"Unrecognized request argument" 400 (or dropped under --lenient-fields, as on every route).
A final assistant message (Anthropic's prefill: continue that turn) is refused: the chat
template would close it and open a new one.
A text block's texts join with no separator, as the OpenAI routes join a message's text parts,
so the same conversation templates to the same prompt ids through either API.
Doesn't know: tenants, the engine, or where a breakpoint falls in tokens (service/messages_usage.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator

from engine.sampling_params import SamplingParams
from service.errors import bad_request
from service.schemas import REFUSED, ChatMessage

MAX_BREAKPOINTS = 4          # Anthropic's limit of cache_control blocks per request
TTLS = ("5m", "1h")
_STRICT = ConfigDict(strict=True, extra="forbid")
# Content blocks Anthropic defines that this server cannot honour (text only), by their type.
_REFUSED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results",
                   "tool_use": "tool use", "tool_result": "tool results", "server_tool_use": "server tools",
                   "web_search_tool_result": "server tools", "thinking": "thinking blocks",
                   "redacted_thinking": "thinking blocks", "container_upload": "containers"}


class CacheControl(BaseModel):
    model_config = _STRICT
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None

    @field_validator("citations", mode="before")
    @classmethod
    def _no_citations(cls, v: Any) -> Any:
        if v not in (None, []):
            raise ValueError("citations are not supported by this server")
        return v


def _blocks(v: Any) -> Any:
    """A string is one text block; a list's blocks must be text blocks (others named and refused)."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if isinstance(v, list):
        if not v:
            raise ValueError("expected a string or at least one content block")
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != "text":
                what = _REFUSED_BLOCKS.get(kind)
                raise ValueError(f"block {i} is of type {kind!r}: not supported by this server "
                                 f"({what + ' are refused; ' if what else ''}only text blocks are)")
        return v
    raise ValueError("expected a string or a list of text blocks")


Content = Annotated[list[TextBlock], BeforeValidator(_blocks, json_schema_input_type=str | list[TextBlock])]


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: Content


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: str | None = None


@dataclass(frozen=True)
class Breakpoint:
    """A cache_control marker, in the chat template's terms: the templated conversation's message
    `message` (the system message first, when there is one), its content's first `chars`
    characters (through the marked block's text), and the marker's ttl."""
    message: int
    chars: int
    ttl: str


@dataclass(frozen=True)
class Conversation:
    """What the chat template renders: OpenAI-style messages, system first, and the breakpoints
    in conversation order."""
    messages: list[ChatMessage]
    breakpoints: tuple[Breakpoint, ...]

    def dicts(self) -> list[dict[str, str]]:
        return [m.to_dict() for m in self.messages]


class _MessagesBody(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation."""
    model_config = _STRICT
    model: str
    messages: list[Message]
    system: Content | None = None
    cache_control: CacheControl | None = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: Any = REFUSED
    context_management: Any = REFUSED
    output_config: Any = REFUSED
    speed: Any = REFUSED

    @field_validator("messages")
    @classmethod
    def _some(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise ValueError("expected at least one message")
        if v[-1].role != "user":
            raise ValueError("the last message must be the user's: continuing a partial assistant turn "
                             "(prefill) is not supported by this server")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v not in (None, []):
            raise ValueError("tool use is not supported by this server")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v is not None and v != {"type": "none"}:
            raise ValueError('tool use is not supported by this server (only {"type": "none"})')
        return v

    @field_validator("thinking", mode="before")
    @classmethod
    def _no_thinking(cls, v: Any) -> Any:
        if v is not None and v != {"type": "disabled"}:
            raise ValueError('extended thinking is not supported by this server (only {"type": "disabled"})')
        return v

    @field_validator("mcp_servers", "context_management", "output_config", "speed", mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("not supported by this server")
        return v

    _conversation: Conversation = PrivateAttr()

    def model_post_init(self, _: Any) -> None:
        self._conversation = self._build()

    def conversation(self) -> Conversation:
        return self._conversation

    def _build(self) -> Conversation:
        """The chat messages and the breakpoints, checked as Anthropic checks them (400s)."""
        messages: list[ChatMessage] = []
        marks: list[Breakpoint] = []
        turns: list[tuple[str, list[TextBlock]]] = ([("system", self.system)] if self.system is not None else [])
        turns += [(m.role, m.content) for m in self.messages]
        for role, blocks in turns:
            chars = 0
            for block in blocks:
                chars += len(block.text)
                if block.cache_control is not None:
                    marks.append(Breakpoint(len(messages), chars, block.cache_control.ttl))
            messages.append(ChatMessage(role=role, content="".join(b.text for b in blocks)))
        if self.cache_control is not None:
            last = Breakpoint(len(messages) - 1, len(messages[-1].content), self.cache_control.ttl)
            if not marks or (marks[-1].message, marks[-1].chars) != (last.message, last.chars):
                marks.append(last)       # the last block already marked: one breakpoint, its own ttl
        if len(marks) > MAX_BREAKPOINTS:
            raise bad_request(f"cache_control: a maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                              f"provided; found {len(marks)} (the top-level cache_control counts as one)",
                              param="cache_control")
        ttls = [b.ttl for b in marks]
        if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
            raise bad_request("cache_control: a ttl='1h' breakpoint must not come after a ttl='5m' one "
                              "(longer-lived breakpoints first, as Anthropic requires)", param="cache_control")
        return Conversation(messages, tuple(marks))


class MessagesRequest(_MessagesBody):
    """POST /v1/messages."""
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)     # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Any = REFUSED
    container: Any = REFUSED
    inference_geo: Any = REFUSED
    diagnostics: Any = REFUSED
    user_profile_id: Any = REFUSED
    workspace_id: Any = REFUSED

    @field_validator("service_tier", "container", "inference_geo", "diagnostics", "user_profile_id", "workspace_id",
                     mode="before")
    @classmethod
    def _refused_here(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("not supported by this server")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"expected an int >= 0, got {v}")
        return v

    @property
    def user_id(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None

    def sampling_params(self) -> SamplingParams:
        """The engine's SamplingParams; its own checks raise ValueError naming the field (ours)."""
        try:
            return SamplingParams(max_tokens=self.max_tokens,
                                  temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p,
                                  top_k=self.top_k or 0,
                                  stop=self.stop_sequences or ())
        except ValueError as e:
            field, sep, why = str(e).partition(":")
            raise ValueError(f"stop_sequences:{why}" if sep and field == "stop" else str(e)) from None


class CountTokensRequest(_MessagesBody):
    """POST /v1/messages/count_tokens: the conversation only (no max_tokens, sampling or stream)."""
