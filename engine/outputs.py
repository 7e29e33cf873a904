"""What a request returns: usage billed by token origin, timing metrics, outputs and stream chunks.

Knows: the shapes users read (`out.usage.hit_tokens_by_tier`, `out.metrics.ttft_s`).
The invariant hit + miss == prompt tokens is checked where a Usage is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from storage.tier_kinds import TIERS     # the one vocabulary of tiers (re-exported for service/)
# Retention classes a client may buy (Anthropic's cache_control ttl "5m"/"1h", OpenAI's
# prompt_cache_retention "24h"), shortest first; storage/retention.py holds their seconds.
RETENTION_CLASSES = ("5m", "1h", "24h")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    hit_tokens_by_tier: dict[str, int]      # per tier name (TIERS): {"device": n, "host": n, "disk": n, "remote": n}
    prompt_cache_miss_tokens: int
    # Retention (issue 39): prompt tokens written into the cache under a retention class (a retained
    # span's tokens that were not read from the cache: Anthropic's cache_creation), class -> tokens;
    # the token-seconds of retention this request bought (each retained block's deadline moved on,
    # times its tokens); and the tokens it asked to retain that were refused (its tenant's bound or
    # the cache's: served and cached as usual, only not kept past LRU).
    cache_write_tokens: dict[str, int] = field(default_factory=dict)
    retained_token_seconds: int = 0
    retention_refused_tokens: int = 0

    def __post_init__(self) -> None:
        # NOTE invariant: every prompt token is billed exactly once, by its origin.
        if self.prompt_cache_hit_tokens + self.prompt_cache_miss_tokens != self.prompt_tokens:
            raise AssertionError(f"usage invariant broken: hit {self.prompt_cache_hit_tokens} + miss "
                                 f"{self.prompt_cache_miss_tokens} != prompt {self.prompt_tokens}")
        unknown = set(self.cache_write_tokens) - set(RETENTION_CLASSES)
        if unknown:
            raise AssertionError(f"cache_write_tokens: unknown retention class {sorted(unknown)[0]!r}")
        if sum(self.cache_write_tokens.values()) > self.prompt_cache_miss_tokens:
            raise AssertionError(f"cache_write_tokens {sum(self.cache_write_tokens.values())} > miss tokens "
                                 f"{self.prompt_cache_miss_tokens}: a token written was computed")

    @property
    def prompt_cache_hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_cache_hit_tokens": self.prompt_cache_hit_tokens,
            "prompt_cache_miss_tokens": self.prompt_cache_miss_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
            **({"cache_write_tokens": dict(self.cache_write_tokens),
                "retained_token_seconds": self.retained_token_seconds,
                "retention_refused_tokens": self.retention_refused_tokens}
               if self.cache_write_tokens or self.retained_token_seconds or self.retention_refused_tokens else {}),
        }


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float            # submit -> first token sampled
    restore_s: float         # time spent promoting host/disk blocks into device pages
    total_s: float           # submit -> finished
    queue_s: float = 0.0     # submit -> admitted
    # Hit tokens (billed as hits) the engine recomputed instead of loading, because the planner
    # predicted that faster (engine/restore_planner.py).
    recomputed_hit_tokens: int = 0


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str       # "stop" | "length" | "abort" (its caller left: engine/abort.py)
    usage: Usage
    metrics: RequestMetrics
    prompt_token_ids: list[int] = field(default_factory=list)
    # Per generated token, its top-n (token id, log-probability), when params.logprobs = n,
    # and the sampled token's own log-probability (it need not be in the top n).
    logprobs: list[list[tuple[int, float]]] | None = None
    token_logprobs: list[float] | None = None
    # n > 1: which choice this is (0..n-1); its usage is the request's (the prompt once, every
    # choice's completion tokens summed), as OpenAI reports and bills it.
    index: int = 0
    # The stop string (params.stop) that ended it; None when it ended otherwise (an end or stop
    # token, its length, an abort): vLLM's `stop_reason` for strings.
    stop_string: str | None = None


@dataclass(frozen=True)
class StreamChunk:
    """Only the new part: text and token ids produced since the previous chunk.
    The last chunk also carries finish_reason, usage and metrics. With params.logprobs = n,
    `logprobs` and `token_logprobs` are CompletionOutput's, for this chunk's token_ids."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[list[tuple[int, float]]] | None = None
    token_logprobs: list[float] | None = None
    index: int = 0           # the choice it belongs to (n > 1)
    stop_string: str | None = None    # the last chunk's: the stop string that ended it (CompletionOutput's)
    # A choice's first chunk: the prompt's hit tokens per tier as it is billed (decided at its
    # admission), so a stream can say what its prompt cost before it ends; None on later chunks.
    hit_tokens_by_tier: dict[str, int] | None = None


@dataclass(frozen=True)
class LookupResult:
    """What the cache holds for a prompt right now; promotes nothing, bills nothing."""
    prompt_tokens: int
    hit_tokens_by_tier: dict[str, int]

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())
