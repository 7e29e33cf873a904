"""SamplingParams: how to pick the next token and when to stop, validated on construction.

The fields and their semantics follow vLLM's (OpenAI's for the two penalties):
- `repetition_penalty` (> 0, 1 = off): the logit of every token seen in the prompt or the output
  is divided by it when positive, multiplied by it when negative (HF/vLLM).
- `frequency_penalty`, `presence_penalty` ([-2, 2], 0 = off): subtracted from a token's logit,
  the first times its count in the output so far, the second once if it occurred at all (OpenAI).
- `min_p` ([0, 1], 0 = off): tokens whose probability (after temperature) is below min_p times
  the top token's are dropped before top-k/top-p.
- `min_tokens`: until that many tokens were generated, the end-of-sequence ids (unless
  ignore_eos) and `stop_token_ids` cannot be sampled and stop strings do not stop.
- `include_stop_str_in_output`: the stop string (or stop token's text) that ended the output
  stays in its text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = no top-k cut
    min_p: float = 0.0                # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0   # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int = 0                 # top-n log-probabilities returned per generated token
    n: int = 1                        # choices: one prefill, n sequences forked on its pages

    def __post_init__(self) -> None:
        # Accept lists/single strings from callers, store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, (str, bytes)) or _int(self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a list of non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not _int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature: expected a number in [0, 100] (0 = greedy), got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not _int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not _int(self.n) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")
        if not _int(self.logprobs) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: expected an int in [0, 20], got {self.logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        if not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected non-negative ints, got {self.stop_token_ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an int in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: expected a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name}: expected a number in [-2, 2] (0 = off), got {v!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits (they need its token history)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
