"""Prices, and what one request costs under them, in exact integer pico-dollars.

Knows: the price table an operator gives (`--prices`, JSON or TOML), its validation, and the
arithmetic of a request's cost: tokens by origin (a cache tier's hit, a miss, output), cache
writes by retention class (engine/outputs.py's RETENTION_CLASSES) and retained token-seconds.
Doesn't know: the ledger, its records or their sums (engine/billing.py).

A price p is micro-dollars per 1M tokens, so one token costs p pico-dollars: n tokens cost
n * p pico-dollars, exactly. A cache-write multiplier m (at most 4 decimal places) is kept as an
integer m4 = m * 10_000, and a written token is billed at miss * m instead of miss: a surcharge of
miss * (m4 - 10_000) / 10_000 pico-dollars on top of its miss. Retention is priced r micro-dollars
per 1M token-hours, r / 3600 pico-dollars per token-second. Those two terms share the denominator
36_000_000 (10_000 * 3600); their sum is rounded to whole pico-dollars once per request, half up
((num + den // 2) // den): at most half a pico-dollar ($5e-13) per request, and none at all for
the token prices, which are exact.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from engine.outputs import RETENTION_CLASSES
from storage.tier_kinds import kind_of, kinds

MULTIPLIER_SCALE = 10_000          # a write multiplier is kept in ten-thousandths
_EXTRA_DENOMINATOR = MULTIPLIER_SCALE * 3600
_MULTIPLIERS = tuple(f"cache_write_{c}" for c in RETENTION_CLASSES)


def _multiplier_e4(name: str, value: Any) -> int:
    """A write multiplier as integer ten-thousandths (1.25 -> 12_500): exact, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise ValueError(f"{name}: expected a number (a multiple of the miss price), got {value!r}")
    try:
        # NOTE: a float by its shortest repr ("1.1", not 1.1000000000000000888): what was written.
        exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
        scaled = exact * MULTIPLIER_SCALE
        if not exact.is_finite() or scaled != scaled.to_integral_value():
            raise ValueError
    except (ValueError, InvalidOperation):
        raise ValueError(f"{name}: expected a number with at most 4 decimal places, got {value!r}") from None
    if exact < 1:
        raise ValueError(f"{name}: expected at least 1 (a written token is a missed token, computed, then kept), "
                         f"got {value!r}")
    return int(scaled)


_DEFAULT_HIT = 27_000
_INTS = ("miss", "completion", "retained_token_hour")


@dataclass(frozen=True, init=False)
class Prices:
    """Integer micro-dollars per 1M tokens, by where a prompt token came from; cache writes as
    multipliers of the miss price; retention per 1M token-hours.

    Defaults: DeepSeek-V3's list prices for a cache miss ($0.27/1M) and for output ($1.10/1M),
    with every cache hit at a tenth of a miss, DeepSeek's published hit/miss ratio. The tiers
    are priced alike by default; an operator may price a disk hit above a device hit, or a
    remote hit (the shared store: network and its memory) above both. A hit's price is named by
    its tier's price key (storage/tier_kinds.py: `device_hit`, `host_hit`, `disk_hit`,
    `remote_hit`, one per registered kind), given as a keyword (`Prices(disk_hit=20)`) and read
    as an attribute (`prices.disk_hit`) or by tier (`prices.hit("disk")`).

    Cache writes (tokens a request asked to retain and did not read from the cache) are billed
    at the miss price times `cache_write_5m` (1.25), `cache_write_1h` (2.0) or `cache_write_24h`
    (1.0): Anthropic's 1.25x for 5 minutes and 2x for an hour; OpenAI charges no premium for its
    24h retention (a write is a miss). `retained_token_hour` (micro-dollars per 1M token-hours of retention bought)
    is 0: Anthropic and OpenAI charge nothing for storage; Gemini's explicit caches do (per 1M
    token-hours, $1.00 to $4.50 on Gemini 2.5: `retained_token_hour = 1000000` for $1).
    A multiplier is a number with at most 4 decimal places (kept exact as ten-thousandths).
    """
    miss: int
    hits: dict[str, int]            # price key -> price, one per registered tier kind
    completion: int
    cache_write_5m: float
    cache_write_1h: float
    cache_write_24h: float
    retained_token_hour: int

    def __init__(self, miss: int = 270_000, completion: int = 1_100_000, cache_write_5m: float = 1.25,
                 cache_write_1h: float = 2.0, cache_write_24h: float = 1.0, retained_token_hour: int = 0,
                 **hits: int) -> None:
        keys = [k.price_key for k in kinds()]
        unknown = sorted(set(hits) - set(keys))
        if unknown:
            raise TypeError(f"Prices: unknown price {unknown[0]!r} (expected some of {sorted(self.keys())})")
        given = {"miss": miss, "completion": completion, "retained_token_hour": retained_token_hour}
        hit_prices = {k: hits.get(k, _DEFAULT_HIT) for k in keys}
        for name, v in [*given.items(), *hit_prices.items()]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                unit = "per 1M token-hours" if name == "retained_token_hour" else "per 1M tokens"
                raise ValueError(f"{name}: expected a non-negative int of micro-dollars {unit}, got {v!r}")
        for name, v in given.items():
            object.__setattr__(self, name, v)
        object.__setattr__(self, "hits", hit_prices)
        e4 = {}
        for name, v in (("cache_write_5m", cache_write_5m), ("cache_write_1h", cache_write_1h),
                        ("cache_write_24h", cache_write_24h)):
            e4[name.removeprefix("cache_write_")] = _multiplier_e4(name, v)
            object.__setattr__(self, name, e4[name.removeprefix("cache_write_")] / MULTIPLIER_SCALE)
        object.__setattr__(self, "_write_e4", e4)     # not a field: equality and to_dict ignore it

    def __getattr__(self, name: str) -> int:
        """A hit's price by its key (`prices.disk_hit`); a tier registered after these prices
        were made costs the default hit price."""
        if name.endswith("_hit") and not name.startswith("_"):
            hits = self.__dict__.get("hits", {})
            if name in hits or any(k.price_key == name for k in kinds()):
                return hits.get(name, _DEFAULT_HIT)
        raise AttributeError(name)

    @classmethod
    def keys(cls) -> list[str]:
        """Every price's name, as a prices file writes it."""
        return ["miss", *(k.price_key for k in kinds()), "completion", *_MULTIPLIERS, "retained_token_hour"]

    def hit(self, tier: str) -> int:
        return getattr(self, kind_of(tier).price_key)

    def write_multiplier_e4(self, retention: str) -> int:
        """The write multiplier of a retention class, in ten-thousandths (exact)."""
        return self._write_e4[retention]

    def cost_pico(self, hit_tokens_by_tier: dict[str, int], miss_tokens: int, completion_tokens: int,
                  cache_write_tokens: dict[str, int], retained_token_seconds: int) -> int:
        """One request's cost in pico-dollars (validated counts; see the module docstring)."""
        exact = (miss_tokens * self.miss + completion_tokens * self.completion
                 + sum(n * self.hit(t) for t, n in hit_tokens_by_tier.items()))
        extra = (sum(n * self.miss * (self._write_e4[c] - MULTIPLIER_SCALE) for c, n in cache_write_tokens.items())
                 * 3600 + retained_token_seconds * self.retained_token_hour * MULTIPLIER_SCALE)
        return exact + (extra + _EXTRA_DENOMINATOR // 2) // _EXTRA_DENOMINATOR

    @classmethod
    def from_dict(cls, data: Any) -> "Prices":
        if not isinstance(data, dict):
            raise ValueError(f"prices: expected a table of prices, got {type(data).__name__}")
        known = cls.keys()
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown price (expected some of {sorted(known)})")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Prices":
        """Prices from a JSON file (`{"miss": 270000, "cache_write_1h": 2, ...}`) or a TOML file
        (`miss = 270000`). A missing key keeps its default. Decimals are read exactly."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = (tomllib.loads(raw.decode(), parse_float=Decimal) if path.endswith(".toml")
                    else json.loads(raw, parse_float=Decimal))
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, int | float]:
        return {k: getattr(self, k) for k in self.keys()}
