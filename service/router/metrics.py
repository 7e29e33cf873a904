"""The router's /metrics (Prometheus), in a registry of its own.

Knows: counters the routes bump (requests routed per backend and status, retries, the prompt
tokens routed and the prefix hit tokens the index predicted for them, requests the router
itself had to fail, clients that left by phase) and, read at scrape time from the backend set, gauges (up, ejected, in
flight, index blocks) and counters (ejections by reason, probes by outcome, readmissions,
request failures that spared the last backend up, the event streams' counters).
Doesn't know: how any of it is decided.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.disconnect import PHASES as DISCONNECT_PHASES
from service.router.backends import BackendSet


class RouterMetrics:
    def __init__(self, backends: BackendSet) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tieredkv_router_requests", "Requests routed, by backend and the status it answered",
                                ["backend", "status"], registry=r)
        self.retries = Counter("tieredkv_router_retries", "Requests sent again to another backend, by the backend "
                               "that failed and why", ["backend", "reason"], registry=r)
        self.prompt_tokens = Counter("tieredkv_router_prompt_tokens", "Prompt tokens routed, by backend "
                                     "(requests whose block hashes were known)", ["backend"], registry=r)
        self.predicted_hit_tokens = Counter("tieredkv_router_predicted_hit_tokens", "Prefix tokens the index "
                                            "predicted the chosen backend holds", ["backend"], registry=r)
        self.failed = Counter("tieredkv_router_failed", "Requests the router answered with an error of its own "
                              "(no backend up, every backend failed)", ["reason"], registry=r)
        self.client_disconnects = Counter("tieredkv_router_client_disconnects", "Clients that closed their "
                                          "connection before their answer was complete, by phase (body, queued, "
                                          "streaming): a client's event, not an error", ["phase"], registry=r)
        for phase in DISCONNECT_PHASES:
            self.client_disconnects.labels(phase)
        self.hash_lookups = Counter("tieredkv_router_block_hash_lookups", "Block-hash lookups on a backend, by "
                                    "outcome", ["outcome"], registry=r)
        r.register(_BackendCollector(backends))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BackendCollector(Collector):
    def __init__(self, backends: BackendSet) -> None:
        self.backends = backends

    def collect(self) -> Iterator:
        up = GaugeMetricFamily("tieredkv_router_backend_up", "1 while the backend gets traffic", labels=["backend"])
        ejected = GaugeMetricFamily("tieredkv_router_backend_ejected", "1 while the backend is ejected (its answers "
                                    "failed; a probe readmits it)", labels=["backend"])
        ejections = CounterMetricFamily("tieredkv_router_ejections", "Backends taken out of rotation by their "
                                        "answers, by reason", labels=["backend", "reason"])
        probes = CounterMetricFamily("tieredkv_router_probes", "Readmission probes of ejected backends, by outcome",
                                     labels=["backend", "outcome"])
        readmitted = CounterMetricFamily("tieredkv_router_readmissions", "Ejected backends a probe readmitted",
                                         labels=["backend"])
        spared = CounterMetricFamily("tieredkv_router_spared", "Request failures that did not eject the backend, "
                                     "the last one up", labels=["backend"])
        flight = GaugeMetricFamily("tieredkv_router_in_flight", "Requests the router has in flight on the backend",
                                   labels=["backend"])
        blocks = GaugeMetricFamily("tieredkv_router_index_blocks", "Blocks the index knows the backend holds "
                                   "(any medium)", labels=["backend"])
        ev = {k: CounterMetricFamily(f"tieredkv_router_event_{k}", help_, labels=["backend"]) for k, help_ in (
            ("batches", "KV event batches applied"), ("gaps", "Sequence gaps seen in the live stream"),
            ("replays", "Replay requests sent"), ("lost", "Event batches neither the stream nor a replay delivered"),
            ("bad", "Event payloads that were not a KVEventBatch"))}
        feed = GaugeMetricFamily("tieredkv_router_event_feed_running", "1 while the backend's KV-event feed is "
                                 "read, 0 once it stopped for good (its index entries go stale)", labels=["backend"])
        for b in self.backends.backends:
            up.add_metric([b.url], 1.0 if b.healthy else 0.0)
            ejected.add_metric([b.url], 1.0 if b.ejected else 0.0)
            for reason, n in sorted(b.ejections.items()):
                ejections.add_metric([b.url, reason], n)
            for outcome in ("passed", "failed"):
                probes.add_metric([b.url, outcome], b.probes.get(outcome, 0))
            readmitted.add_metric([b.url], b.readmissions)
            spared.add_metric([b.url], b.spared)
            flight.add_metric([b.url], b.in_flight)
            blocks.add_metric([b.url], self.backends.index.blocks(b.name))
            if b.subscriber is not None:
                for k, fam in ev.items():
                    fam.add_metric([b.url], getattr(b.subscriber.stats, k))
                feed.add_metric([b.url], b.subscriber.stats.running)
        yield from (up, ejected, ejections, probes, readmitted, spared, flight, blocks, *ev.values(), feed)
