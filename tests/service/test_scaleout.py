"""Two real HTTP servers sharing one real valkey-server: what server A computed is a remote hit
on server B, billed as such, with the same greedy text; B's /v1/cache/status and /metrics say so.
Then the store is killed: both servers still answer every request (200, every prompt token a
miss), and their status and metrics show the open breaker and the errors.

Each server is its own engine (tiny random-weight model, same seed, its own disk directory)
behind its own uvicorn on loopback; the only thing they share is the store.
"""
from __future__ import annotations

import contextlib
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import ServerThread, check_usage
from tests.service.tiny_engine import BLOCK_SIZE, build_engine
from tools.valkey_servers import ValkeyServer

PASSWORD = "s3cret-pw"
MODEL = "random:llama:seed0"      # what build_engine serves (tests/service/tiny_engine.py)
TEXT = ("Two servers behind one load balancer share a remote tier: a long system prompt computed on "
        "one of them is read, verified and decoded on the other instead of being computed again. ")


@contextlib.contextmanager
def two_servers(tmp_path, tokenizer, url: str, **cache_kw):
    """Servers A and B (their engines closed with them), one store between them."""
    kw = dict(remote_url=url, remote_write="write_through", **cache_kw)
    with ServerThread(build_engine(tmp_path / "a", tokenizer, **kw)) as a, \
            ServerThread(build_engine(tmp_path / "b", tokenizer, **kw)) as b:
        with a.client() as ca, b.client() as cb:
            yield ca, cb


def complete(client, prompt: str, user: str = "acme") -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                             "user": user})
    assert r.status_code == 200, r.text
    check_usage(r.json()["usage"])
    return r.json()


def cached(prompt_tokens: int) -> int:
    """Prompt tokens in full blocks, capped at prompt - 1: what a full hit serves."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def wait_until_in_store(client, prompt: str, tokens: int, user: str = "acme") -> None:
    """A writes through in the background (disk writer, then the remote writer): ask B's
    /v1/cache/lookup (which asks the store; it promotes and bills nothing) until all of it is there."""
    deadline = time.monotonic() + 20
    while True:
        r = client.post("/v1/cache/lookup", json={"prompt": prompt, "user": user})
        assert r.status_code == 200, r.text
        if r.json()["hit_tokens_by_tier"]["remote"] == tokens:
            return
        assert time.monotonic() < deadline, f"never all in the store: {r.json()}"
        time.sleep(0.05)


def scrape(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_a_prompt_computed_on_one_server_is_billed_as_remote_hits_on_the_other(tmp_path, tokenizer) -> None:
    server = ValkeyServer("--requirepass", PASSWORD)
    try:
        server.start()
        url = f"valkey://:{PASSWORD}@127.0.0.1:{server.port}"
        # restore_policy="load": B restores the hit (its calibrated planner could recompute it).
        with two_servers(tmp_path, tokenizer, url, restore_policy="load") as (a, b):
            prompt = TEXT * 3
            first = complete(a, prompt)
            n = first["usage"]["prompt_tokens"]
            assert first["usage"]["prompt_cache_miss_tokens"] == n
            wait_until_in_store(b, prompt, cached(n))

            second = complete(b, prompt)
            u = second["usage"]
            assert u["prompt_cache_hit_tokens_by_tier"] == {"device": 0, "host": 0, "disk": 0, "remote": cached(n)}
            assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"] == n
            assert second["choices"][0]["text"] == first["choices"][0]["text"]

            status = b.get("/v1/cache/status").json()["tiers"]["remote"]
            assert status["enabled"] and status["breaker"] == "closed" and status["errors"] == 0
            assert status["hit_tokens"] == cached(n) and status["promotions"] == cached(n) // BLOCK_SIZE
            assert status["store_hits"] >= cached(n) // BLOCK_SIZE
            assert status["url"] == f"valkey://:***@127.0.0.1:{server.port}"
            metrics = scrape(b)
            assert metrics[("tieredkv_cache_hit_tokens_total", (("tier", "remote"),))] == cached(n)
            assert metrics[("tieredkv_prompt_tokens_total", (("origin", "remote"),))] == cached(n)
            assert metrics[("tieredkv_remote_hits_total", ())] == status["store_hits"]
            assert metrics[("tieredkv_remote_errors_total", ())] == 0
            assert metrics[("tieredkv_remote_breaker_state", (("state", "closed"),))] == 1
            assert metrics[("tieredkv_remote_breaker_state", (("state", "open"),))] == 0
            # The store's own capacity is not this server's to report.
            assert ("tieredkv_cache_capacity_bytes", (("tier", "remote"),)) not in metrics
            assert scrape(a)[("tieredkv_remote_writes_total", ())] >= cached(n) // BLOCK_SIZE
            for c in (a, b):
                assert PASSWORD not in c.get("/v1/cache/status").text and PASSWORD not in c.get("/metrics").text

            # B keeps what it read: its next request is a device hit. Another tenant hits nothing.
            again = complete(b, prompt)["usage"]["prompt_cache_hit_tokens_by_tier"]
            assert again == {"device": cached(n), "host": 0, "disk": 0, "remote": 0}
            other = complete(b, prompt, user="globex")["usage"]
            assert other["prompt_cache_miss_tokens"] == n
    finally:
        server.cleanup()


def test_with_the_store_killed_both_servers_answer_and_report_the_open_breaker(tmp_path, tokenizer) -> None:
    server = ValkeyServer()
    try:
        server.start()
        # A cooldown longer than the test: the breaker, once open, stays open while we look. A
        # stopped store refuses connections at once, so the timeout is never waited for; a generous
        # one keeps a loaded machine's slow answer (store up) from counting as an outage.
        with two_servers(tmp_path, tokenizer, server.url, remote_timeout_s=10, remote_retry_s=60) as (a, b):
            prompt = TEXT + "Before the store went away."
            first = complete(a, prompt)
            wait_until_in_store(b, prompt, cached(first["usage"]["prompt_tokens"]))

            server.stop()
            for i in range(4):
                p = f"[{i}] After the store went away: " + TEXT     # its first block differs: shares none
                outs = [complete(c, p) for c in (a, b)]
                for o in outs:      # every prompt token computed, on both
                    assert o["usage"]["prompt_cache_miss_tokens"] == o["usage"]["prompt_tokens"]
                assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
            for c in (a, b):
                status = c.get("/v1/cache/status").json()["tiers"]["remote"]
                assert status["breaker"] == "open" and status["breaker_opened"] >= 1, status
                assert status["errors"] >= 3 and status["last_error"], status
                metrics = scrape(c)
                assert metrics[("tieredkv_remote_breaker_state", (("state", "open"),))] == 1
                assert metrics[("tieredkv_remote_breaker_state", (("state", "closed"),))] == 0
                assert metrics[("tieredkv_remote_errors_total", ())] == status["errors"] >= 3
                assert metrics[("tieredkv_remote_breaker_openings_total", ())] >= 1
            # B's device pool still holds nothing of A's prompt, and the store is gone: a miss, not an error.
            assert complete(b, prompt)["usage"]["prompt_cache_miss_tokens"] > 0
    finally:
        server.cleanup()
