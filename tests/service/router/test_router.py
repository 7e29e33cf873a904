"""`tieredkv route` in front of real tiny-engine servers on loopback (tests/service/tiny_engine.py).

A request follows its prefix to the backend that holds it, streams and usage pass through, keys
pass through (the backend derives the tenant), a backend killed mid-run costs no request, and --
with the backends publishing KV events -- a prefix computed on a backend behind the router's back
draws requests there, and a restarted router rebuilds its index from replay alone.
"""
from __future__ import annotations

import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.router.proxy import BACKEND_HEADER
from service.settings import ServiceSettings
from tests.service.conftest import ServerProcess, ServerThread, check_usage, sse_events, write_keys
from tests.service.router.harness import MODEL, RouterThread, complete, events_kw, wait_for
from tests.service.tiny_engine import BLOCK_SIZE, build_engine
from tests.kv_event_keys import key_dir
from storage.kv_events.keys import write_keypair

EVENTS = bool(events_kw())
needs_events = pytest.mark.skipif(not EVENTS, reason="this tree's servers publish no KV events yet (kv-events branch)")


def doc(name: str, n: int = 6) -> str:
    return f"Document {name}. " + " ".join(f"Clause {i} of {name} says the {name} warranty covers part {i}." for i in range(n))


@pytest.fixture(scope="module")
def backends(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("router")
    with ServerThread(build_engine(tmp / "a", tokenizer, **events_kw())) as a, \
            ServerThread(build_engine(tmp / "b", tokenizer, **events_kw())) as b, \
            ServerThread(build_engine(tmp / "c", tokenizer, **events_kw())) as c:
        yield a, b, c


@pytest.fixture(scope="module")
def router(backends):
    with RouterThread(*(s.url for s in backends)) as r:
        yield r


def scrape(client) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(client.get("/metrics").text) for s in fam.samples}


def test_block_hashes_are_the_keys_a_request_looks_up(backends) -> None:
    server = backends[0]
    engine = server.engine
    with server.client() as c:
        r = c.post("/v1/cache/block_hashes", json={"prompt": doc("hashes"), "user": "acme"})
        assert r.status_code == 200, r.text
        got = r.json()
        ids, keys = engine.prompt_keys(doc("hashes"), tenant="acme")
        assert got == {"tenant": "acme", "block_size": BLOCK_SIZE, "prompt_tokens": len(ids),
                       "hashes": [k.hash.hex() for k in keys]}
        assert len(got["hashes"]) == (len(ids) - 1) // BLOCK_SIZE           # capped at len - 1 tokens
        other = c.post("/v1/cache/block_hashes", json={"prompt": doc("hashes"), "user": "globex"}).json()
        assert not set(other["hashes"]) & set(got["hashes"])                # tenants' namespaces differ
        messages = [{"role": "user", "content": doc("hashes")}]
        chat = c.post("/v1/cache/block_hashes", json={"messages": messages, "user": "acme"}).json()
        chat_ids = engine.apply_chat_template(messages)
        assert chat["hashes"] == [k.hash.hex() for k in engine.prompt_keys(chat_ids, tenant="acme")[1]]
        assert c.post("/v1/cache/block_hashes", json={"user": "acme"}).status_code == 400
        assert c.post("/v1/cache/block_hashes", json={"prompt": "hi", "max_tokens": 3}).status_code == 400


def test_a_request_follows_its_prefix_and_a_new_prefix_goes_to_the_least_loaded(router, backends) -> None:
    with router.client() as c:
        first = complete(c, doc("alpha") + " Question: one?")
        assert first.status_code == 200, first.text
        home = first.headers[BACKEND_HEADER]
        other = complete(c, doc("beta") + " Question: one?")
        assert other.headers[BACKEND_HEADER] != home            # a miss everywhere: the least routed
        for q in ("two?", "three?"):
            r = complete(c, doc("alpha") + f" Question: {q}")
            assert r.status_code == 200 and r.headers[BACKEND_HEADER] == home
            u = r.json()["usage"]
            check_usage(u)
            assert u["prompt_cache_hit_tokens_by_tier"]["device"] >= len(doc("alpha")) // 8   # it did hit there
        again = complete(c, doc("beta") + " Question: two?")
        assert again.headers[BACKEND_HEADER] == other.headers[BACKEND_HEADER]
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
        m = scrape(c)
        assert m[("tieredkv_router_requests_total", (("backend", home), ("status", "200")))] >= 3
        assert m[("tieredkv_router_predicted_hit_tokens_total", (("backend", home),))] > 0
        assert m[("tieredkv_router_backend_up", (("backend", home),))] == 1
    view = router.backend_view(home)
    assert view["healthy"] and view["in_flight"] == 0 and view["predicted_blocks"] > 0


def test_a_stream_passes_through_with_its_usage(router) -> None:
    prompt = doc("gamma") + " Question: streamed?"
    with router.client() as c:
        plain = complete(c, prompt, user="streams").json()
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0, "user": "streams", "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        chat = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "user": "streams",
                                                    "messages": [{"role": "user", "content": prompt}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    check_usage(usage)
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"] and usage["prompt_cache_hit_tokens"] > 0
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == plain["choices"][0]["text"]


def test_keys_pass_through_and_the_backend_derives_the_tenant(tmp_path, tokenizer) -> None:
    keys = write_keys(tmp_path / "keys.json", {"sk-acme-0001": {"tenant": "acme"},
                                               "sk-ops-00001": {"tenant": "ops", "role": "admin"}})
    settings = ServiceSettings(api_keys_file=keys)
    with ServerThread(build_engine(tmp_path / "a", tokenizer, **events_kw()), settings) as a, \
            ServerThread(build_engine(tmp_path / "b", tokenizer, **events_kw()), settings) as b, \
            RouterThread(a.url, b.url, api_key="sk-ops-00001") as router:
        with router.client() as c:
            assert complete(c, doc("keys")).status_code == 401
            wrong = c.post("/v1/completions", headers={"Authorization": "Bearer sk-nope-0000"},
                           json={"model": MODEL, "prompt": "hi"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with router.client(headers={"Authorization": "Bearer sk-acme-0001"}) as c:
            first = complete(c, doc("keys") + " One?", user="someone-else")
            assert first.status_code == 200, first.text
            second = complete(c, doc("keys") + " Two?", user="a-third")
            assert second.headers[BACKEND_HEADER] == first.headers[BACKEND_HEADER]
            assert second.json()["usage"]["prompt_cache_hit_tokens"] > 0     # one tenant (acme), whatever `user` says
            assert c.get("/v1/models").status_code == 200
        home = first.headers[BACKEND_HEADER]
        with ServerThread.client(a if a.url == home else b) as direct:
            bill = direct.get("/v1/cache/billing", headers={"Authorization": "Bearer sk-acme-0001"}).json()
            assert bill["tenant"] == "acme" and bill["requests"] >= 2


def test_a_backend_killed_mid_run_costs_no_request(tmp_path, tokenizer_dir) -> None:
    a = ServerProcess(tmp_path / "a", tokenizer_dir)
    b = ServerProcess(tmp_path / "b", tokenizer_dir)
    try:
        with RouterThread(a.url, b.url, health_interval_s=0.3) as router, router.client() as c:
            on_a = router.router.backends.by_name(a.url)
            done: list[tuple[int, str]] = []
            lock = threading.Lock()
            killed = threading.Event()

            def kill_when_busy() -> None:
                # SIGKILL while requests are in flight on A: their connections break mid-request.
                wait_for(lambda: len(done) >= 8 and on_a.in_flight >= 1, timeout=60, what="requests on A")
                a.proc.kill()
                killed.set()

            def one(i: int) -> None:
                r = complete(c, doc(f"kill-{i % 4}") + f" Question {i}?", user="kill", max_tokens=24)
                with lock:
                    done.append((r.status_code, r.headers.get(BACKEND_HEADER, "") if killed.is_set() else ""))
            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, range(48)))
            killer.join()
            assert killed.is_set() and [s for s, _ in done] == [200] * 48
            assert not router.backend_view(a.url)["healthy"]
            # Once it is known down, nothing more goes there.
            assert [u for _, u in done[-16:]] == [b.url] * 16
            m = scrape(c)
            assert sum(v for (name, _), v in m.items() if name == "tieredkv_router_failed_total") == 0
            retried = {k[1]: v for k, v in m.items() if k[0] == "tieredkv_router_retries_total"}
            assert retried and all(dict(labels)["backend"] == a.url for labels in retried), retried
    finally:
        a.stop()
        b.stop()


@needs_events
def test_a_prefix_computed_behind_the_routers_back_draws_requests_to_its_backend(router, backends) -> None:
    b = backends[1]
    prompt = doc("delta", 10)
    with b.client() as direct:
        warm = complete(direct, prompt + " Warm?")
        assert warm.status_code == 200
    blocks = (warm.json()["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE
    # The index learns it from B's events alone.
    wait_for(lambda: router.backend_view(b.url)["index_blocks"] >= blocks, what="B's events")
    with router.client() as c:
        for q in ("One?", "Two?"):
            r = complete(c, prompt + f" {q}")
            assert r.headers[BACKEND_HEADER] == b.url
            assert r.json()["usage"]["prompt_cache_hit_tokens_by_tier"]["device"] > 0


@needs_events
def test_a_restarted_router_rebuilds_its_index_from_replay(backends) -> None:
    urls = [s.url for s in backends]
    prompt = doc("epsilon", 10)
    with RouterThread(*urls, prediction_ttl_s=0) as first, first.client() as c:
        home = complete(c, prompt + " One?").headers[BACKEND_HEADER]
        wait_for(lambda: first.backend_view(home)["index_blocks"] > 0, what="events")
        blocks = first.backend_view(home)["index_blocks"]
    # A new router, predictions off: only the replayed events can send the request home.
    with RouterThread(*urls, prediction_ttl_s=0) as second:
        wait_for(lambda: second.backend_view(home)["index_blocks"] >= blocks, what="replay")
        assert second.backend_view(home)["events"]["replayed"] > 0
        with second.client() as c:
            for other in urls:              # load elsewhere would not matter: the prefix outweighs it
                if other != home:
                    assert complete(c, doc(f"noise-{other[-5:]}")).status_code == 200
            assert complete(c, prompt + " Two?").headers[BACKEND_HEADER] == home


@needs_events
def test_the_backends_events_reach_only_a_router_they_allow(backends, tmp_path) -> None:
    """The backends' KV events take CURVE keys (issue 44): a router with the allowed key (every
    router above) and one pinning the backends' own public key learn from them; one without a key,
    with a stranger's, or pinning another server's key learns nothing and routes by predictions."""
    a = backends[0]
    prompt = doc("zeta", 10)
    with a.client() as direct:
        assert complete(direct, prompt + " Warm?").status_code == 200          # in a's replay buffer
    stranger_public, stranger_secret = write_keypair(tmp_path, "stranger")
    for kw in ({"kv_events_key": None}, {"kv_events_key": str(stranger_secret), "replay_timeout_s": 0.3},
               {"kv_events_server_keys": (str(stranger_public),)}):
        with RouterThread(a.url, prediction_ttl_s=0, **kw) as r:
            if kw.get("kv_events_key", "") is None or "kv_events_server_keys" in kw:
                assert r.backend_view(a.url)["events"] is None, kw               # not subscribed at all
            else:                                                               # subscribed, refused
                wait_for(lambda: r.backend_view(a.url)["events"]["replay_failures"] >= 1, what="the refusal")
                assert r.backend_view(a.url)["events"]["last_seq"] == -1
            assert r.backend_view(a.url)["healthy"] and r.backend_view(a.url)["index_blocks"] == 0, kw
    with RouterThread(a.url, prediction_ttl_s=0, kv_events_server_keys=(str(key_dir() / "server.key"),)) as r:
        wait_for(lambda: r.backend_view(a.url)["index_blocks"] > 0, what="the pinned backend's replay")


@needs_events
def test_a_backend_on_a_private_ipc_socket_feeds_a_router_of_its_user(tmp_path, tokenizer) -> None:
    """No keys on either side: the socket file is in a directory only this user can enter."""
    private = tempfile.mkdtemp(prefix="tkv-ipc-")                       # short: a socket path is <= 107 bytes
    engine = build_engine(tmp_path / "a", tokenizer, kv_events=f"ipc://{private}/kv/events.sock")
    with ServerThread(engine) as a, RouterThread(a.url, prediction_ttl_s=0, kv_events_key=None) as r:
        with a.client() as direct:
            assert complete(direct, doc("eta", 10)).status_code == 200
        wait_for(lambda: r.backend_view(a.url)["index_blocks"] > 0, what="the ipc backend's events")
        assert r.backend_view(a.url)["events"]["endpoint"] == f"ipc://{private}/kv/events.sock"
