"""vLLM's metric names on a live server: each series scraped from /metrics with vLLM's type,
labels and buckets, and its value equal to what the requests were billed; route templates;
one id per request; polling kept off the request log."""
from __future__ import annotations

import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.settings import ServiceSettings
from service.vllm_metrics import REQUEST_LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, buckets_1_2_5
from tests.service.conftest import ServerThread, check_usage, sse_events
from tests.service.test_cache_routes import scrape_until
from tests.service.test_serve_ux import request_lines
from tests.service.tiny_engine import BLOCK_SIZE, build_engine

PROMPT = "A tiered KV cache keeps hot blocks on the device and cold ones on disk, " * 3
COMPL = "/v1/completions"
SERVED = "tiny-served"

# name -> (type, vLLM's own bucket edges for a histogram); the label set is always model_name + engine.
EXPECTED = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:external_prefix_cache_queries": ("counter", None),
    "vllm:external_prefix_cache_hits": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("histogram", TPOT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("histogram", TPOT_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
}


def families(client: httpx.Client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    got = [s.value for s in fams[family].samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def test_vllm_series_have_vllm_names_types_labels_and_buckets_and_count_what_was_billed(tmp_path, tokenizer) -> None:
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(served_model_name=SERVED)) as s, s.client() as c:
        before = families(c)
        for name, (kind, buckets) in EXPECTED.items():
            fam = before[name]
            assert fam.type == kind, (name, fam.type)
            for smp in fam.samples:
                assert {"model_name", "engine"} <= set(smp.labels), (name, smp.labels)
                assert smp.labels["model_name"] == SERVED and smp.labels["engine"] == "0"
            if buckets is not None:
                edges = sorted(float(x.labels["le"]) for x in fam.samples if x.name == name + "_bucket")
                assert edges == sorted([*buckets, float("inf")]), name
        counts = sorted(float(x.labels["le"]) for x in before["vllm:request_prompt_tokens"].samples
                        if x.name == "vllm:request_prompt_tokens_bucket")
        assert counts == [*buckets_1_2_5(eng.max_context), float("inf")]
        assert sorted(x.labels["finished_reason"] for x in before["vllm:request_success"].samples
                      if x.name == "vllm:request_success_total") == ["abort", "length", "stop"]

        body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        first = c.post(COMPL, json=body)
        second = c.post(COMPL, json=body)             # hits the first one's blocks in the device pool
        with c.stream("POST", COMPL, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            third = [e for e in sse_events(r) if isinstance(e, dict) and e.get("usage")][-1]["usage"]
        usages = [first.json()["usage"], second.json()["usage"], third]
        for u in usages:
            check_usage(u)
        assert usages[1]["prompt_cache_hit_tokens_by_tier"]["device"] >= BLOCK_SIZE
        scrape_until(c, lambda m: m.get(("vllm:e2e_request_latency_seconds_count",
                                          (("engine", "0"), ("model_name", SERVED))), 0) >= 3)
        after = families(c)

    def delta(family: str, name: str, **labels) -> float:
        return (sample(after, family, name, model_name=SERVED, **labels)
                - sample(before, family, name, model_name=SERVED, **labels))

    prompt = sum(u["prompt_tokens"] for u in usages)
    device = sum(u["prompt_cache_hit_tokens_by_tier"]["device"] for u in usages)
    hits = sum(u["prompt_cache_hit_tokens"] for u in usages)
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 15
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == device
    assert delta("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_queries_total") == prompt - device
    assert delta("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total") == hits - device
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert delta(f"vllm:{name}_seconds", f"vllm:{name}_seconds_count") == 3, name
    # One interval per token after the first: 4 in each of the 3 requests (the stream's as sent).
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 12
    assert delta("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 12
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt
    # Nothing runs or waits once the answers are in; the pool's pages are all released.
    assert sample(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert sample(after, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert sample(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0


def test_every_route_is_counted_by_its_template(client) -> None:
    for path in ("/openapi.json", "/docs", "/dashboard", "/v1/models", "/no/such/route"):
        client.get(path)

    def count(m, route, status):
        return m.get(("tieredkv_http_requests_total", (("route", route), ("status", status))), 0)
    m = scrape_until(client, lambda m: count(m, "unmatched", "404") >= 1 and count(m, "/openapi.json", "200") >= 1)
    for route in ("/openapi.json", "/docs", "/dashboard", "/v1/models"):
        assert count(m, route, "200") >= 1, route


def test_one_id_in_body_header_and_log_and_polling_kept_off_the_log(tmp_path, tokenizer, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tieredkv.requests")
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng) as s, s.client() as c:
        chat = {"model": eng.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=chat)
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as st:
            stream_ids = {e["id"] for e in sse_events(st) if isinstance(e, dict)}
            stream_header = st.headers["x-request-id"]
        c.get("/health")
        c.get("/metrics")
        c.get("/v1/cache/status", headers={"X-Tieredkv-Client": "dashboard"})
        c.get("/v1/cache/status")                      # a person's curl: logged
        request_lines(caplog, 6)      # each lands once its response is sent: wait for the six (bounded)
    # The server has stopped (every line it writes is in): all of them, not only the first six.
    # (Waiting for a seventh line that never comes cost this test its 30 s bound on every run.)
    lines = [rec for rec in caplog.records if rec.name == "tieredkv.requests"]
    info = [rec.request_fields for rec in lines if rec.levelno == logging.INFO]
    debug = [rec.request_fields for rec in lines if rec.levelno == logging.DEBUG]
    assert r.json()["id"].startswith("chatcmpl-") and r.json()["id"] == r.headers["x-request-id"]
    assert stream_ids == {stream_header} and stream_header.startswith("chatcmpl-")
    assert [f["id"] for f in info[:2]] == [r.headers["x-request-id"], stream_header]
    assert [f["path"] for f in info] == ["/v1/chat/completions", "/v1/chat/completions", "/v1/cache/status"]
    assert [f["path"] for f in debug] == ["/health", "/metrics", "/v1/cache/status"]


def test_log_probes_writes_polling_at_info(tmp_path, tokenizer, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(log_probes=True)) as s, s.client() as c:
        c.get("/health")
        c.get("/v1/cache/status", headers={"X-Tieredkv-Client": "dashboard"})
        lines = request_lines(caplog, 2)
    assert [rec.request_fields["path"] for rec in lines] == ["/health", "/v1/cache/status"]
