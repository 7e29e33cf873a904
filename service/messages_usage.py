"""Anthropic's usage for a Messages request: where its cache_control breakpoints fall in the
prompt's tokens, and its prompt tokens split the way Anthropic reports them.

Knows:
- A breakpoint's token position. The engine runs the templated prompt, so a position is counted
  in the template's tokens, never the text's: for each breakpoint the chat template renders the
  conversation cut right after the marked block's text (the messages before it, and its message's
  content through that block; no generation prompt), and the position is the number of leading
  tokens that rendering shares with the whole prompt. Sound for any template and tokenizer: a
  position never passes a token the whole prompt does not have there too. Its limits: where the
  block's last characters and the next block's first ones make one token, the position is that
  token earlier; a template that renders a message differently once later ones follow places it
  where the two renderings part; a template that cannot render the cut conversation (one that
  insists on ending with a user turn) puts it at the previous breakpoint's position (its segment
  is then input_tokens). A breakpoint on a message's last block covers that message's closing
  tokens too. One template render and tokenization per breakpoint, on the request's worker thread.
- The split, over the engine's usage: cache_read_input_tokens = prompt tokens served from the
  cache (any tier; every full block is cached, so a read may run past the last breakpoint);
  cache_creation_input_tokens = tokens up to the last breakpoint that were not read, each
  breakpoint's segment (from the one before it) under its own ttl in `cache_creation`;
  input_tokens = the rest. input + creation + read == prompt tokens, and with no breakpoint
  nothing is created. The read by tier is ours, as `cache_read_input_tokens_by_tier` (as our
  OpenAI routes add DeepSeek's fields).
- The retention asked (`TemplatedPrompt.spans`): each breakpoint's segment kept under its ttl
  (engine/retain_spans.py). Once the engine answered, what it billed stands: creation is the
  usage's cache_write_tokens (a segment a tenant's bound refused is not created: it is input, and
  `cache_retention_refused_input_tokens` says how many).
Doesn't know: HTTP, the request's schema beyond its Conversation, or how the engine caches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.outputs import TIERS, Usage
from engine.retain_spans import RetainSpan
from service.messages_schemas import Breakpoint, Conversation

log = logging.getLogger("tieredkv.service")


@dataclass(frozen=True)
class Mark:
    """A breakpoint placed: the prompt tokens it covers (from the start) and its ttl."""
    tokens: int
    ttl: str


@dataclass(frozen=True)
class PromptSplit:
    """A prompt's tokens as Anthropic reports them."""
    input_tokens: int
    cache_read_input_tokens: int
    created_5m: int
    created_1h: int

    @property
    def cache_creation_input_tokens(self) -> int:
        return self.created_5m + self.created_1h


def split(prompt_tokens: int, read_tokens: int, marks: list[Mark]) -> PromptSplit:
    """`read_tokens` of `prompt_tokens` served from the cache (a prefix: a hit stops at the first
    miss); each mark's segment not read is created under its ttl."""
    created = {"5m": 0, "1h": 0}
    start = 0
    for mark in marks:
        end = min(mark.tokens, prompt_tokens)
        created[mark.ttl] += max(0, end - max(start, read_tokens))
        start = max(start, end)
    made = created["5m"] + created["1h"]
    return PromptSplit(prompt_tokens - read_tokens - made, read_tokens, created["5m"], created["1h"])


def usage_body(usage: Usage, marks: list[Mark], output_tokens: int | None = None) -> dict[str, Any]:
    """The `usage` object of a message (or a stream's message_start / message_delta):
    Anthropic's fields and our read by tier. `output_tokens`: instead of the usage's own."""
    s = split(usage.prompt_tokens, usage.prompt_cache_hit_tokens, marks)
    if usage.cache_write_tokens or usage.retention_refused_tokens:      # what the engine billed
        w = usage.cache_write_tokens
        made = w.get("5m", 0) + w.get("1h", 0) + w.get("24h", 0)
        s = PromptSplit(usage.prompt_tokens - s.cache_read_input_tokens - made, s.cache_read_input_tokens,
                        w.get("5m", 0), w.get("1h", 0) + w.get("24h", 0))
    refused = {"cache_retention_refused_input_tokens": usage.retention_refused_tokens} \
        if usage.retention_refused_tokens else {}
    return {**refused,"input_tokens": s.input_tokens,
            "cache_creation_input_tokens": s.cache_creation_input_tokens,
            "cache_read_input_tokens": s.cache_read_input_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": s.created_5m, "ephemeral_1h_input_tokens": s.created_1h},
            "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens_by_tier": {t: usage.hit_tokens_by_tier.get(t, 0) for t in TIERS}}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def place(engine: Any, conversation: Conversation, ids: list[int]) -> list[Mark]:
    """Each breakpoint's position in `ids` (the whole conversation's prompt ids), in order."""
    messages = conversation.dicts()
    marks: list[Mark] = []
    for bp in conversation.breakpoints:
        at = marks[-1].tokens if marks else 0
        try:
            part = engine.apply_chat_template(_cut(messages, bp), add_generation_prompt=False)
            at = max(at, common_prefix(part, ids))
        except Exception as e:       # a template that cannot end there: the breakpoint adds nothing
            log.debug("cache_control: the chat template cannot render the conversation cut at a breakpoint "
                      "(%s: %s); it is placed at the previous one", type(e).__name__, e)
        marks.append(Mark(at, bp.ttl))
    return marks


def _cut(messages: list[dict[str, str]], bp: Breakpoint) -> list[dict[str, str]]:
    """The conversation up to and including the marked block's text."""
    last = messages[bp.message]
    return [*messages[:bp.message], {"role": last["role"], "content": last["content"][:bp.chars]}]


class TemplatedPrompt:
    """One request's prompt through the chat template (as /v1/chat/completions makes it) and its
    breakpoints placed. `ids()` runs on the request's worker thread, before the engine call;
    `marks` and `tokens` are read on the event loop once that call returned or its stream's
    first chunk arrived (handed over through the dispatcher's future or queue)."""

    def __init__(self, engine: Any, conversation: Conversation) -> None:
        self.engine = engine
        self.conversation = conversation
        self.marks: list[Mark] = []
        self.tokens = 0

    def ids(self) -> list[int]:
        ids = self.engine.apply_chat_template(self.conversation.dicts())
        self.marks = place(self.engine, self.conversation, ids) if self.conversation.breakpoints else []
        self.tokens = len(ids)
        return ids

    def spans(self) -> tuple[RetainSpan, ...]:
        """The retention the breakpoints ask (after ids(): each segment under its ttl)."""
        return tuple(RetainSpan(m.tokens, m.ttl) for m in self.marks)

    def usage_before(self, hit_tokens_by_tier: dict[str, int]) -> Usage:
        """The prompt's usage before any output (a stream's message_start), from its first chunk's hits."""
        hits = dict(hit_tokens_by_tier)
        return Usage(self.tokens, 0, hits, self.tokens - sum(hits.values()))
