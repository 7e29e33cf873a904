"""How a tier's status reads outside the cache, said by the tier: its /ready state and the fields
/ready repeats, its own /metrics series, its lines under `tieredkv status` -- typed rows a tier
kind's `health` (storage/tier_kinds.py) gives from the status dict its tier reports, so the
service and the CLI loop over the kinds and name none.

Knows: the rows' shapes, and what a tier that says nothing more reads as (on or off; no series
or lines of its own).
Doesn't know: any tier (each room says its own: storage/disk/health.py, storage/remote/health.py),
HTTP, Prometheus or rich (service/metrics.py, service/app.py and tieredkv/cli.py draw the rows).
Nothing heavy is imported: the CLI and the router read it without the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class MetricRow:
    """One sample of a tier's own series, named `tieredkv_<tier name>_<suffix>`."""
    suffix: str
    help: str
    value: float
    counter: bool = False                  # a running total (else a gauge)
    label: tuple[str, str] | None = None   # (name, value): one sample of a labelled family; rows of one
                                           # family come one after another


@dataclass(frozen=True)
class Span:
    text: str = ""
    style: str = ""            # "" plain, "warn" (a smaller cache), "alert" (a tier not serving)
    nbytes: int | None = None  # a size, drawn by the reader ("1.5GiB": storage/config.py's format_size)


def size(nbytes: int) -> Span:
    return Span(nbytes=nbytes)


@dataclass(frozen=True)
class StatusLine:
    """One line under `tieredkv status`'s table: its spans, in order (values are text, never markup)."""
    spans: tuple[Span, ...]


def line(*parts: str | Span) -> StatusLine:
    """A StatusLine of plain strings and styled spans."""
    return StatusLine(tuple(p if isinstance(p, Span) else Span(p) for p in parts))


class TierHealth:
    """A tier that says nothing beyond its shared counters: "ok", or "off" when not running."""
    ready_fields: tuple[str, ...] = ()     # its status fields /ready repeats under its name

    def ready(self, status: dict) -> str:
        """Its state in /ready's `tiers` (never a reason to be unready: a smaller cache still serves)."""
        return "ok" if status.get("enabled", True) else "off"

    def metrics(self, status: dict) -> Iterable[MetricRow]:
        return ()

    def lines(self, status: dict) -> Iterable[StatusLine]:
        return ()


class AlwaysReady(TierHealth):
    """The device pool: always there."""

    def ready(self, status: dict) -> str:
        return "ok"


def number(value: object) -> bool:
    """A status value a series can carry (never a bool, None or text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
