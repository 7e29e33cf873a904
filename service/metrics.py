"""Prometheus metrics for one app: request counts, latency histograms, the cache's tiers (the
shared per-tier families, and each tier's own series as its kind says them: storage/tier_health.py).

Knows: metric names and labels, and that the cache's numbers are read from
`engine.cache_status()` at scrape time (a custom collector), so they are never stale and
never double-counted. Every app has its own CollectorRegistry -- never the global one -- so
two apps in one process (tests) do not collide.
Doesn't know: HTTP routes or how a request was served beyond its usage and timings.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.abort import ABORT_REASONS
from engine.outputs import TIERS
from storage.tier_health import MetricRow
from storage.tier_kinds import DEVICE, is_local, kinds
from service.disconnect import PHASES as DISCONNECT_PHASES
from service.vllm_metrics import VllmMetrics, status_metrics

log = logging.getLogger("tieredkv.service")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# (key in a tier's status, metric suffix, help, is a running total)
_TIER_FIELDS = (
    ("capacity_bytes", "capacity_bytes", "Bytes the tier may hold", False),
    ("used_bytes", "used_bytes", "Bytes of cached blocks the tier holds", False),
    ("blocks", "blocks", "Cached blocks the tier holds", False),
    ("hit_tokens", "hit_tokens", "Prompt tokens served from the tier", True),
    ("promotions", "promotions", "Blocks promoted from the tier into device pages", True),
    ("recomputed_hit_tokens", "recomputed_hit_tokens", "Hit tokens held in the tier that were recomputed "
     "by choice (compute-or-load), billed as hits all the same", True),
    ("abandoned", "abandoned_blocks", "Blocks being read from the tier that a request stopped waiting for "
     "(its load deadline passed) and computed instead", True),
    ("demotions", "demotions", "Blocks demoted into the tier from the one above", True),
    ("evictions", "evictions", "Blocks evicted from the tier", True),
)

# A linked tier's capacity, contents and evictions are its store's (the remote tier's: maxmemory,
# its LRU; `tieredkv inspect --remote-url` reads them there).
_STORE_OWN = frozenset({"capacity_bytes", "used_bytes", "blocks", "evictions"})


class CacheCollector:
    """Reads engine.cache_status() on every scrape and reports each tier's numbers."""

    def __init__(self, cache_status: Callable[[], dict[str, Any]], vllm_labels: tuple[str, str]) -> None:
        self._cache_status = cache_status
        self._vllm_labels = vllm_labels

    def describe(self) -> Iterable[Metric]:
        return []      # no scrape at registration time; names are fixed and cannot collide

    def collect(self) -> Iterable[Metric]:
        try:
            status = self._cache_status()
        except Exception:      # a closed engine or a bug must not break the rest of /metrics
            log.warning("cache_status() failed during a metrics scrape", exc_info=True)
            return
        yield from status_metrics(status, self._vllm_labels)
        tiers = status.get("tiers", {})
        for key, suffix, help_text, running_total in _TIER_FIELDS:
            name = f"tieredkv_cache_{suffix}"
            fam = (CounterMetricFamily(name, help_text, labels=["tier"]) if running_total
                   else GaugeMetricFamily(name, help_text, labels=["tier"]))
            for tier in TIERS:
                if not is_local(tier) and key in _STORE_OWN:
                    continue       # the store's own (shared by every server): not this server's to report
                value = tiers.get(tier, {}).get(key)
                if _is_number(value):
                    fam.add_metric([tier], float(value))
            yield fam
        for kind in kinds():       # each tier's own series, as its kind says them (tieredkv_<tier>_*)
            yield from _tier_families(kind.name, kind.health.metrics(tiers.get(kind.name) or {}))
        billing = status.get("billing", {})
        if _is_number(billing.get("unwritten")):
            # An alert on tieredkv_billing_unwritten > 0 fires while requests are answered with their
            # bills only in memory (engine/billing_writer.py; /ready is 503 meanwhile).
            yield _single(GaugeMetricFamily, "tieredkv_billing_unwritten", "Finished requests whose bill is kept "
                          "in memory because the ledger cannot be written", billing["unwritten"])
        if _is_number(billing.get("held_in_memory")):
            yield _single(GaugeMetricFamily, "tieredkv_billing_held_in_memory", "Of those, the bills held in memory "
                          "only (the reserve could not take them): bounded, spilled at close", billing["held_in_memory"])
        if _is_number(billing.get("refused")):
            yield _single(CounterMetricFamily, "tieredkv_billing_refused", "Requests failed with 503 because their "
                          "bill could be held nowhere (--on-billing-failure serve, past the bound)", billing["refused"])
        yield from retention_metrics(status.get("retention") or {})
        cost = status.get("cost_model", {})
        rates = cost.get("restore_bytes_per_s", {})
        if rates:
            fam = GaugeMetricFamily("tieredkv_restore_bytes_per_second", "Each tier's restore bandwidth into the "
                                    "pool (a restore takes latency + bytes / this), fitted to the loader's fills "
                                    "(calibrated at start)", labels=["tier"])
            lat = GaugeMetricFamily("tieredkv_restore_latency_seconds", "Each tier's restore latency (a fill's "
                                    "fixed cost), fitted to the loader's fills (calibrated at start)", labels=["tier"])
            for tier, r in rates.items():
                if _is_number(r.get("bytes_per_s")):
                    fam.add_metric([tier], float(r["bytes_per_s"]))
                if _is_number(r.get("latency_s")):
                    lat.add_metric([tier], float(r["latency_s"]))
            yield fam
            yield lat
        errors = [("prefill", cost.get("prefill", {}).get("median_error"))] + \
            [(t, r.get("median_error")) for t, r in rates.items()]
        if any(_is_number(e) for _, e in errors):
            fam = GaugeMetricFamily("tieredkv_cost_model_error_ratio", "The cost model's median relative error "
                                    "over its last predictions (prefill steps; each tier's fills)", labels=["part"])
            for part, e in errors:
                if _is_number(e):
                    fam.add_metric([part], float(e))
            yield fam
        if _is_number(cost.get("prefill", {}).get("prefill_2048_s")):
            yield _single(GaugeMetricFamily, "tieredkv_prefill_2048_seconds", "Predicted time to compute 2048 new "
                          "tokens, from the engine's step times", cost["prefill"]["prefill_2048_s"])
        aborted = status.get("engine", {}).get("aborted")
        if isinstance(aborted, dict):
            # engine/abort.py: requests whose caller left (client_disconnected), that ran past the
            # service's timeout (timeout), or whose library caller closed its stream (caller_closed);
            # counted as the ledger counts requests: a batch of prompts is one per prompt.
            fam = CounterMetricFamily("tieredkv_requests_aborted", "Generation requests aborted before they "
                                      "finished, by reason (their pages released, billed for what was sent)",
                                      labels=["reason"])
            for reason in sorted(set(ABORT_REASONS) | set(aborted)):
                fam.add_metric([reason], float(aborted.get(reason, 0)))
            yield fam
        events = status.get("kv_events", {})
        if events.get("enabled"):
            yield _single(CounterMetricFamily, "tieredkv_kv_events_published", "KV events (BlockStored, "
                          "BlockRemoved, AllBlocksCleared) sent on the events endpoint", events.get("published", 0))
            yield _single(CounterMetricFamily, "tieredkv_kv_events_dropped", "KV events dropped before "
                          "publishing (the publisher's queue full): subscribers' indexes miss them",
                          events.get("dropped", 0))


def _tier_families(tier: str, rows: Iterable[MetricRow]) -> Iterable[Metric]:
    """A tier's rows as metric families named tieredkv_<tier>_<suffix>: a labelled family of the
    rows of one suffix that follow each other, else one unlabelled sample each."""
    fam, at = None, None
    for row in rows:
        name = f"tieredkv_{tier}_{row.suffix}"
        if row.label is None:
            if fam is not None:
                yield fam
                fam, at = None, None
            yield _single(CounterMetricFamily if row.counter else GaugeMetricFamily, name, row.help, row.value)
            continue
        if fam is None or at != name:
            if fam is not None:
                yield fam
            kind = CounterMetricFamily if row.counter else GaugeMetricFamily
            fam, at = kind(name, row.help, labels=[row.label[0]]), name
        fam.add_metric([row.label[1]], float(row.value))
    if fam is not None:
        yield fam


def _single(family: type, name: str, help_text: str, value: float) -> Metric:
    """A metric family of one unlabelled sample."""
    fam = family(name, help_text)
    fam.add_metric([], float(value))
    return fam


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ServiceMetrics:
    """Our series (tieredkv_*) and vLLM's (vllm:*, service/vllm_metrics.py) in one registry.
    `model_name`: the served name (vLLM's model_name label); `max_model_len`: the context, which
    bounds vLLM's token-count buckets."""

    def __init__(self, cache_status: Callable[[], dict[str, Any]], in_flight: Callable[[], int],
                 model_name: str = "unknown", max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.vllm = VllmMetrics(r, model_name, max_model_len)
        self.requests = Counter("tieredkv_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("tieredkv_ttft_seconds", "Submit to first token, per generation request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        # NOTE: a second histogram rather than a label on the first, so existing queries and alerts
        # on tieredkv_ttft_seconds keep their meaning.
        self.ttft_by_source = Histogram("tieredkv_ttft_by_source_seconds", "Submit to first token, per generation "
                                        "request, by its source: the slowest tier that served any of its prompt "
                                        "tokens, or miss when none was cached", ["source"],
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.recent_ttft = RecentTTFT()
        self.restore = Histogram("tieredkv_restore_seconds",
                                 "Time promoting host/disk blocks into device pages, per request that restored any",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("tieredkv_request_seconds", "Submit to finish, per generation request",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tieredkv_prompt_tokens", "Prompt tokens by origin (a cache tier, or miss)",
                                     ["origin"], registry=r)
        self.completion_tokens = Counter("tieredkv_completion_tokens", "Generated tokens", registry=r)
        # NOTE: a client's event, not an error: alert on 5xx, not on this (service/disconnect.py).
        self.client_disconnects = Counter("tieredkv_client_disconnects", "Clients that closed their connection "
                                          "before their answer was complete, by phase: body (before the request's "
                                          "body was read), queued (before the response began), streaming (mid-stream)",
                                          ["phase"], registry=r)
        for phase in DISCONNECT_PHASES:
            self.client_disconnects.labels(phase)
        Gauge("tieredkv_requests_in_flight", "Generation requests admitted and not finished",
              registry=r).set_function(in_flight)
        r.register(CacheCollector(cache_status, self.vllm.labels))

    def observe_request(self, usage: Any, metrics: Any, finish_reason: str | None = None,
                        intervals: list[float] | None = None) -> None:
        """One generation that ended: its usage (engine.outputs.Usage), timings (RequestMetrics;
        None for an aborted one), finish reason, and inter-token intervals where they were seen
        (a stream's; service/vllm_metrics.py)."""
        self.vllm.observe(usage, metrics, finish_reason, intervals)
        if usage is not None:
            for tier, n in usage.hit_tokens_by_tier.items():
                self.prompt_tokens.labels(tier).inc(n)
            self.prompt_tokens.labels("miss").inc(usage.prompt_cache_miss_tokens)
            self.completion_tokens.inc(usage.completion_tokens)
        if metrics is not None:
            self.ttft.observe(metrics.ttft_s)
            source = ttft_source(usage)
            self.ttft_by_source.labels(source).observe(metrics.ttft_s)
            self.recent_ttft.add(source, metrics.ttft_s, usage.prompt_tokens if usage is not None else 0)
            self.latency.observe(metrics.total_s)
            restored = usage is not None and any(usage.hit_tokens_by_tier.get(t, 0) for t in TIERS if t != DEVICE.name)
            if restored:
                self.restore.observe(metrics.restore_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def ttft_sources() -> tuple[str, ...]:
    """Where a prompt can come from: each tier kind, fastest first, then a miss."""
    return (*TIERS, "miss")


def ttft_source(usage: Any) -> str:
    """Where a request's prompt came from, for TTFT: the slowest tier that served any of its
    tokens (a single disk block makes a request wait for a disk read), or miss."""
    hits = getattr(usage, "hit_tokens_by_tier", None) or {}
    for tier in reversed(TIERS):
        if hits.get(tier, 0) > 0:
            return tier
    return "miss"


class RecentTTFT:
    """The last `window` TTFTs of each source, for /v1/cache/status's quantiles (the histogram's
    buckets are too coarse to read a median from, and Prometheus is not always there). Also per
    1,000 prompt tokens, and by prompt length (`by_length`): sources compared on prompts of
    different lengths otherwise read as "hits are slow" when the hits were the long prompts."""

    def __init__(self, window: int = 256) -> None:
        self._lock = threading.Lock()
        self._sources = ttft_sources()
        self._recent = {s: deque(maxlen=window) for s in self._sources}
        self._per_1k = {s: deque(maxlen=window) for s in self._sources}
        self._sized: dict[str, deque[tuple[int, float]]] = {s: deque(maxlen=window) for s in self._sources}
        self._count = dict.fromkeys(self._sources, 0)

    def add(self, source: str, seconds: float, prompt_tokens: int = 0) -> None:
        with self._lock:
            self._recent[source].append(seconds)
            if prompt_tokens > 0:
                self._per_1k[source].append(seconds * 1000 / prompt_tokens)
                self._sized[source].append((prompt_tokens, seconds))
            self._count[source] += 1

    def by_length(self) -> dict[str, dict[str, Any]]:
        """Like with like: the recent TTFTs bucketed by prompt length (a power of two up to the
        next: "32-63" tokens), only the buckets where a miss and a hit of some tier both ran, each
        with every source's p50 (None where it has none) and count. A device hit of a long prompt
        beside misses of short ones read as "a hit is slower than a miss"; within a bucket it cannot."""
        with self._lock:
            snap = {s: list(self._sized[s]) for s in self._sources}
        buckets: dict[int, dict[str, list[float]]] = {}
        for source, xs in snap.items():
            for tokens, seconds in xs:
                buckets.setdefault(tokens.bit_length() - 1, {}).setdefault(source, []).append(seconds)
        out: dict[str, dict[str, Any]] = {}
        for k in sorted(buckets):
            got = buckets[k]
            if "miss" not in got or not any(s in got for s in self._sources if s != "miss"):
                continue
            lo, hi = 1 << k, (1 << (k + 1)) - 1
            out[f"{lo}-{hi}"] = {"tokens_min": lo, "tokens_max": hi,
                                 "p50_s": {s: _quantile(sorted(got.get(s, [])), 0.5) for s in self._sources},
                                 "requests": {s: len(got.get(s, [])) for s in self._sources}}
        return out

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per source: requests since start, and over the recent window: p50, p90, last (seconds),
        and p50, p90 of seconds per 1,000 prompt tokens."""
        with self._lock:
            snap = {s: (self._count[s], list(self._recent[s]), sorted(self._per_1k[s])) for s in self._sources}
        out = {}
        for s, (count, xs, per) in snap.items():
            last = xs[-1] if xs else None
            xs.sort()
            out[s] = {"requests": count, "window": len(xs), "p50_s": _quantile(xs, 0.5), "p90_s": _quantile(xs, 0.9),
                      "last_s": last, "p50_per_1k_s": _quantile(per, 0.5), "p90_per_1k_s": _quantile(per, 0.9)}
        return out


def _quantile(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def retention_metrics(r: dict) -> Iterable[Metric]:
    """Retention (issue 39): the blocks and bytes each tenant keeps past LRU, the bound, and the
    retentions that ran out or were refused."""
    if not r:
        return
    blocks = GaugeMetricFamily("tieredkv_retained_blocks", "Blocks a tenant retains past LRU now "
                               "(cache_control ttl, prompt_cache_retention)", labels=["tenant"])
    held = GaugeMetricFamily("tieredkv_retained_bytes", "Bytes a tenant retains past LRU now (raw block bytes)",
                             labels=["tenant"])
    for tenant, t in (r.get("tenants") or {}).items():
        blocks.add_metric([tenant], float(t.get("blocks", 0)))
        held.add_metric([tenant], float(t.get("bytes", 0)))
    yield blocks
    yield held
    if _is_number(r.get("max_bytes")):
        yield _single(GaugeMetricFamily, "tieredkv_retention_bound_bytes", "What every tenant's retention together "
                      "may hold (--max-retained)", r["max_bytes"])
    for key, help_text in (("expired", "Retentions (a block, a tenant) whose deadline passed"),
                           ("refused", "Blocks a request asked to retain that a bound refused")):
        if _is_number(r.get(key)):
            yield _single(CounterMetricFamily, f"tieredkv_retention_{key}", help_text, r[key])
