"""vLLM's Prometheus metrics, under vLLM's own names, types, labels and buckets, beside ours.

Knows: the `vllm:*` series a vLLM Grafana dashboard, an alert written for vLLM or the Gateway
API inference extension / llm-d endpoint picker reads (it scrapes `vllm:num_requests_waiting`
and `vllm:kv_cache_usage_perc` to balance model servers), declared as vLLM v1 declares them
(vllm/v1/metrics/loggers.py, PrometheusStatLogger): labels `model_name` (the served name) and
`engine` ("0": one engine per server), the same bucket edges, counters exposed with `_total`.
What each means here:
- `vllm:num_requests_running`: sequences in the engine's batch; `vllm:num_requests_waiting`:
  admitted and not running yet (waiting for a slot, or for their hit's blocks to load -- vLLM
  counts a request waiting for remote KV as waiting too). Read from the engine at scrape time.
- `vllm:kv_cache_usage_perc`: the device pool's pages held by running requests, 0..1 (cached
  pages no request holds are free to take, as vLLM's evictable blocks are).
- `vllm:prefix_cache_queries` / `_hits`: prompt tokens, and those served from the device pool
  (vLLM's local prefix cache); `vllm:external_prefix_cache_queries` / `_hits`: the tokens past
  the device's hit, and those served from host, disk or the remote store (vLLM's KV connector
  counters, where LMCache's hits land).
- `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:request_queue_time_seconds` (submit -> admitted), `vllm:request_prefill_time_seconds`
  (admitted -> first token: loads included), `vllm:request_decode_time_seconds` (first token ->
  finished), `vllm:request_inference_time_seconds` (admitted -> finished),
  `vllm:request_time_per_output_token_seconds` (a request's decode time / (tokens - 1)).
- `vllm:inter_token_latency_seconds` (and its deprecated name `vllm:time_per_output_token_seconds`):
  one sample per generated token after the first. A streamed request's are the gaps between its
  chunks as the engine handed them over; a non-streamed request's tokens are not seen one by one,
  so each of its intervals is its mean (sum and count exact, quantiles smoothed within it).
- `vllm:num_preemptions`: the engine's preemptions, read at scrape time.
Doesn't know: HTTP routes or how a request was served beyond its usage, timings and finish.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# vLLM's bucket edges (vllm/v1/metrics/loggers.py), copied so a histogram_quantile over both reads the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """The per-request vLLM series, observed when a request finishes (`observe`); the scheduler
    gauges and the preemption counter come from the engine's status at scrape (`collect_status`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = (model_name, ENGINE_INDEX)
        r = registry

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r).labels(*self.labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished and aborted requests (cached ones included).")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated (an aborted request's: those sent).")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the device pool's prefix cache.")
        self.external_queries = counter("vllm:external_prefix_cache_queries", "Prompt tokens past the device pool's hit, "
                                        "looked up in the tiers below it (host, disk, the remote store).")
        self.external_hits = counter("vllm:external_prefix_cache_hits", "Prompt tokens served from the tiers below the "
                                     "device pool (host, disk, the remote store).")
        success = Counter("vllm:request_success", "Requests that ended, by finish reason.",
                          LABELS + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        counts = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               counts)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", counts)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Submit to first token, per request.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             TPOT_BUCKETS)
        self.tpot_deprecated = histogram("vllm:time_per_output_token_seconds", "Time between consecutive generated "
                                         "tokens (vLLM's deprecated name of vllm:inter_token_latency_seconds).",
                                         TPOT_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "A request's decode time per generated token after the first.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Submit to finish, per request.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Submit to admission into the batch, per request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Admission to finish, per request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Admission to first token (loads of its hit included), per request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "First token to finish, per request.", REQUEST_LATENCY_BUCKETS)

    def observe(self, usage: Any, metrics: Any, finish_reason: str | None, intervals: Sequence[float] | None) -> None:
        """One request that ended: its usage (tokens by origin), timings (None for an aborted one,
        whose latencies are not a finished request's), finish reason, and its inter-token
        intervals where they were seen (a stream's), else None."""
        if usage is not None:
            device = usage.hit_tokens_by_tier.get("device", 0)
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.generation_tokens.inc(usage.completion_tokens)
            self.prefix_queries.inc(usage.prompt_tokens)
            self.prefix_hits.inc(device)
            self.external_queries.inc(usage.prompt_tokens - device)
            self.external_hits.inc(usage.prompt_cache_hit_tokens - device)
        if finish_reason in self.success:
            self.success[finish_reason].inc()
        if metrics is None or usage is None:
            return
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_generation_tokens.observe(usage.completion_tokens)
        ttft, total, queue = metrics.ttft_s, metrics.total_s, metrics.queue_s
        self.ttft.observe(ttft)
        self.e2e.observe(total)
        self.queue.observe(queue)
        self.prefill.observe(max(0.0, ttft - queue))
        self.decode.observe(max(0.0, total - ttft))
        self.inference.observe(max(0.0, total - queue))
        n = usage.completion_tokens
        if n < 2:
            return
        mean = max(0.0, total - ttft) / (n - 1)
        self.request_tpot.observe(mean)
        for gap in (intervals if intervals else [mean] * (n - 1)):
            self.itl.observe(gap)
            self.tpot_deprecated.observe(gap)


def status_metrics(status: dict[str, Any], labels: tuple[str, str]) -> Iterable[Metric]:
    """The series read from the engine's status at scrape time: vLLM's scheduler gauges, KV-cache
    usage and preemptions, and our own running / waiting / loading gauges."""
    engine = status.get("engine", {})
    running, waiting, loading = (engine.get(k) for k in ("running", "waiting", "loading"))
    if _is_count(running) and _is_count(waiting) and _is_count(loading):
        yield _one(GaugeMetricFamily("vllm:num_requests_running", "Requests in the engine's batch.",
                                     labels=LABELS), labels, running)
        yield _one(GaugeMetricFamily("vllm:num_requests_waiting", "Requests admitted and not in the batch yet (waiting for a slot or for their hit to load).",
                                     labels=LABELS), labels, waiting + loading)
        fam = GaugeMetricFamily("tieredkv_requests", "Generation requests in the engine by state: running (in the "
                                "batch), waiting (for a slot) or loading (waiting for their hit's blocks to load)",
                                labels=["state"])
        for state, n in (("running", running), ("waiting", waiting), ("loading", loading)):
            fam.add_metric([state], float(n))
        yield fam
    if _is_count(engine.get("preemptions")):
        yield _one(CounterMetricFamily("vllm:num_preemptions", "Sequences the engine preempted.",
                                       labels=LABELS), labels, engine["preemptions"])
    device = status.get("tiers", {}).get("device", {})
    pages, in_use = device.get("pages"), device.get("in_use_pages")
    if _is_count(pages) and _is_count(in_use) and pages > 0:
        yield _one(GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of the device pool's pages held by requests (1: all).",
                                     labels=LABELS), labels, in_use / pages)


def _one(fam: Any, labels: tuple[str, str], value: float) -> Metric:
    fam.add_metric(list(labels), float(value))
    return fam


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
