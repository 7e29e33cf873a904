"""Cache routes on a real server: status, lookup, billing (exact sums), flush/drop, /metrics."""
from __future__ import annotations

import time
from datetime import datetime, timezone

from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import check_usage
from tests.service.tiny_engine import BLOCK_SIZE
from engine.billing import Prices

TEXT = "Tiered caches keep hot blocks on the device, warm ones in host memory and cold ones on disk"


def complete(client, engine, prompt, user, max_tokens=4):
    r = client.post("/v1/completions", json={"model": engine.model_name, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "user": user})
    assert r.status_code == 200, r.text
    check_usage(r.json()["usage"])
    return r.json()["usage"]


def full_blocks(n: int) -> int:
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_status_has_every_tier(client, engine):
    s = client.get("/v1/cache/status").json()
    assert s["model"] == engine.model_name and s["block_size"] == BLOCK_SIZE
    for tier in ("device", "host", "disk"):
        for key in ("capacity_bytes", "used_bytes", "blocks", "hit_tokens", "promotions", "demotions", "evictions"):
            assert isinstance(s["tiers"][tier][key], int), (tier, key)
    assert s["tiers"]["device"]["capacity_bytes"] == 1 << 20
    assert {"compression_ratio", "pending_writes"} <= set(s["tiers"]["disk"])


def test_lookup_reports_hits_without_promoting_or_billing(client, engine, tokenizer):
    ids = tokenizer(TEXT + " (lookup)")["input_ids"]
    n = len(ids)
    before = client.post("/v1/cache/lookup", json={"prompt": ids, "user": "look"}).json()
    assert before == {"tenant": "look", "prompt_tokens": n, "hit_tokens": 0, "miss_tokens": n,
                      "hit_tokens_by_tier": {"device": 0, "host": 0, "disk": 0, "remote": 0}}
    complete(client, engine, ids, "look")
    status = client.get("/v1/cache/status").json()
    after = client.post("/v1/cache/lookup", json={"prompt": TEXT + " (lookup)", "user": "look"}).json()
    assert after["hit_tokens_by_tier"] == {"device": full_blocks(n), "host": 0, "disk": 0, "remote": 0}
    assert after["miss_tokens"] == n - full_blocks(n)
    # Nothing was served, promoted or billed by the lookups.
    assert client.get("/v1/cache/status").json()["tiers"] == status["tiers"]
    assert client.get("/v1/cache/billing", params={"tenant": "look"}).json()["requests"] == 1
    # Another tenant's lookup never sees this tenant's blocks.
    assert client.post("/v1/cache/lookup", json={"prompt": ids, "user": "look-2"}).json()["hit_tokens"] == 0


def test_lookup_of_chat_messages(client, engine):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ids = engine.apply_chat_template(messages)
    r = client.post("/v1/chat/completions", json={"model": engine.model_name, "messages": messages, "max_tokens": 2,
                                                  "temperature": 0, "user": "look-chat"})
    assert r.status_code == 200
    got = client.post("/v1/cache/lookup", json={"messages": messages, "user": "look-chat"}).json()
    assert got["prompt_tokens"] == len(ids) and got["hit_tokens_by_tier"]["device"] == full_blocks(len(ids))


def test_billing_counts_exactly(client, engine, tokenizer):
    prompts = [TEXT + " (bill one)", TEXT + " (bill one)", "A different, shorter prompt"]
    usages = [complete(client, engine, p, "bill-a", max_tokens=k) for p, k in zip(prompts, (3, 5, 2))]
    complete(client, engine, "someone else", "bill-b")
    bill = client.get("/v1/cache/billing", params={"tenant": "bill-a"}).json()
    assert bill["tenant"] == "bill-a" and bill["requests"] == 3
    for key in ("prompt_tokens", "completion_tokens"):
        assert bill[key] == sum(u[key] for u in usages)
    assert bill["miss_tokens"] == sum(u["prompt_cache_miss_tokens"] for u in usages)
    for tier in ("device", "host", "disk"):
        assert bill["hit_tokens_by_tier"][tier] == sum(u["prompt_cache_hit_tokens_by_tier"][tier] for u in usages)
    assert bill["hit_tokens_by_tier"]["device"] == full_blocks(usages[1]["prompt_tokens"])
    p = Prices()
    assert bill["cost_pico"] == (bill["miss_tokens"] * p.miss + bill["completion_tokens"] * p.completion
                                 + bill["hit_tokens_by_tier"]["device"] * p.device_hit)
    today = datetime.now(timezone.utc).date().isoformat()
    assert bill["days"][today]["requests"] == 3 and bill["days"][today]["cost_pico"] == bill["cost_pico"]
    # Without ?tenant an admin (every caller, on a keyless server) gets every tenant.
    everyone = client.get("/v1/cache/billing").json()
    assert everyone["tenants"]["bill-a"] == bill and everyone["tenants"]["bill-b"]["requests"] == 1
    assert everyone["total"]["requests"] == sum(t["requests"] for t in everyone["tenants"].values())


def test_billing_shows_cache_writes_by_class_and_retained_token_hours(client, engine):
    """Issue 39: a bill with cache writes, as the engine's billing writer commits one, read back over HTTP."""
    import threading
    done = threading.Event()
    entry = engine.billing.prepare("bill-ret", "ret-1", 48, 2, {"device": 16}, 32,
                                   cache_write_tokens={"5m": 16, "1h": 8}, retained_token_seconds=24 * 3600)
    engine.billing.submit(entry, lambda recorded, error: done.set())
    assert done.wait(60)
    bill = client.get("/v1/cache/billing", params={"tenant": "bill-ret"}).json()
    assert bill["cache_write_tokens"] == {"5m": 16, "1h": 8, "24h": 0}
    assert bill["retained_token_seconds"] == 86_400 and bill["retained_token_hours"] == 24
    p = Prices()
    assert bill["cost_pico"] == 32 * p.miss + 16 * p.device_hit + 2 * p.completion + 16 * p.miss // 4 + 8 * p.miss
    everyone = client.get("/v1/cache/billing").json()
    assert everyone["tenants"]["bill-ret"] == bill and everyone["prices"]["cache_write_1h"] == 2.0
    assert everyone["total"]["cache_write_tokens"]["5m"] >= 16


def test_flush_then_drop_serves_disk_hits_then_device_hits(client, engine, tokenizer):
    ids = tokenizer(TEXT + " (flush)")["input_ids"]
    hit = full_blocks(len(ids))
    complete(client, engine, ids, "flush")
    r = client.post("/v1/cache/flush", json={"tier": None})
    assert r.status_code == 200 and r.json()["flushed"] == "all" and r.json()["complete"] is True
    assert r.json()["written"] >= hit // engine.block_size
    assert r.json()["cache"]["tiers"]["disk"]["pending_writes"] == 0
    for tier in ("device", "host"):
        r = client.post("/v1/cache/flush", json={"tier": tier})
        assert r.json()["flushed"] == tier and r.json()["cache"]["tiers"][tier]["blocks"] == 0
    assert client.post("/v1/cache/lookup", json={"prompt": ids, "user": "flush"}).json()["hit_tokens_by_tier"] == \
        {"device": 0, "host": 0, "disk": hit, "remote": 0}
    assert complete(client, engine, ids, "flush")["prompt_cache_hit_tokens_by_tier"] == {"device": 0, "host": 0, "disk": hit, "remote": 0}
    assert complete(client, engine, ids, "flush")["prompt_cache_hit_tokens_by_tier"] == {"device": hit, "host": 0, "disk": 0, "remote": 0}
    # An empty body flushes too; dropping the disk tier empties it.
    assert client.post("/v1/cache/flush").json()["flushed"] == "all"
    assert client.post("/v1/cache/flush", json={"tier": "disk"}).json()["cache"]["tiers"]["disk"]["blocks"] == 0


def scrape(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def scrape_until(client, done, timeout: float = 60.0) -> dict[tuple, float]:
    """A scrape for which done(scrape) holds, polled (a deadline, not a bet on timing): the HTTP
    request counter is incremented after the response is sent, so the client can scrape first."""
    deadline = time.monotonic() + timeout
    while not done(got := scrape(client)):
        assert time.monotonic() < deadline, "timed out waiting for the metrics"
        time.sleep(0.02)
    return got


def scrape_settled(client, timeout: float = 60.0) -> tuple[dict[tuple, float], dict]:
    """A scrape with the tiers' status read just before and just after it, equal: the cache did
    not change meanwhile (a request's disk -> host prefetch may land after the request ends)."""
    deadline = time.monotonic() + timeout
    while True:
        first = client.get("/v1/cache/status").json()["tiers"]
        got = scrape(client)
        if client.get("/v1/cache/status").json()["tiers"] == first:
            return got, first
        assert time.monotonic() < deadline, "the cache never settled"
        time.sleep(0.05)


def test_metrics(client, engine, tokenizer):
    ids = tokenizer(TEXT + " (metrics)")["input_ids"]
    completions = ("tieredkv_http_requests_total", (("route", "/v1/completions"), ("status", "200")))
    start = scrape(client).get(completions, 0)
    complete(client, engine, ids, "metrics")
    client.post("/v1/cache/flush", json={})
    client.post("/v1/cache/flush", json={"tier": "device"})
    client.post("/v1/cache/flush", json={"tier": "host"})
    # Counted after its response (see scrape_until): `before` must include the first completion.
    before = scrape_until(client, lambda m: m.get(completions, 0) >= start + 1)
    usage = complete(client, engine, ids, "metrics")                   # disk hits: one restore
    scrape_until(client, lambda m: m.get(completions, 0) >= before[completions] + 1)
    after, status = scrape_settled(client)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("tieredkv_ttft_seconds_count") == 1
    assert delta("tieredkv_request_seconds_count") == 1
    assert delta("tieredkv_restore_seconds_count") == 1
    assert delta("tieredkv_prompt_tokens_total", origin="disk") == usage["prompt_cache_hit_tokens_by_tier"]["disk"] > 0
    assert delta("tieredkv_prompt_tokens_total", origin="miss") == usage["prompt_cache_miss_tokens"]
    assert delta("tieredkv_completion_tokens_total") == usage["completion_tokens"]
    assert delta("tieredkv_http_requests_total", route="/v1/completions", status="200") == 1
    # Each disk hit was loaded, or recomputed by the compute-or-load planner's choice.
    assert (delta("tieredkv_cache_promotions_total", tier="disk")
            + delta("tieredkv_cache_recomputed_hit_tokens_total", tier="disk") // BLOCK_SIZE
            == usage["prompt_cache_hit_tokens_by_tier"]["disk"] // BLOCK_SIZE)
    for tier in ("device", "host", "disk"):
        assert after[("tieredkv_cache_blocks", (("tier", tier),))] == status[tier]["blocks"]
        assert after[("tieredkv_cache_capacity_bytes", (("tier", tier),))] == status[tier]["capacity_bytes"]
        assert after[("tieredkv_cache_hit_tokens_total", (("tier", tier),))] == status[tier]["hit_tokens"]
        assert (after[("tieredkv_cache_recomputed_hit_tokens_total", (("tier", tier),))]
                == status[tier]["recomputed_hit_tokens"])
    assert after[("tieredkv_requests_in_flight", ())] == 0
    client.get("/no/such/route")
    scrape_until(client, lambda m: m.get(("tieredkv_http_requests_total", (("route", "unmatched"), ("status", "404"))), 0) >= 1)
