"""The router against hostile clients and broken backends (issue 28, item 10): real router, real
tiny-engine servers on loopback, and -- for the broken backend -- tools/fault_front.py, a real
HTTP peer in front of a real server that answers garbage when told to.

A client's bytes a backend refuses are refused by the router the same way (400, OpenAI's body),
and the router lives on; a backend whose /v1/cache/status is not UTF-8 does not stop the router
starting; a backend that answers garbage while its /health says 200 is ejected, costs no
request, never gets its garbage to a client, and is readmitted by a probe once it recovers.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.router.proxy import BACKEND_HEADER
from tests.service.conftest import ServerThread, sse_events
from tests.service.router.harness import MODEL, RouterThread, complete, wait_for
from tests.service.tiny_engine import build_engine
from tools.fault_front import FaultFront

FAST = {"eject_cooldown_s": 0.2, "eject_cooldown_max_s": 1.0, "health_interval_s": 0.2}
JSON = {"Content-Type": "application/json"}

# Bytes a client may send that no backend accepts: each must be a 400, as a backend answers it.
HOSTILE = {
    "nested": b"[" * 5000,
    "nested_in_a_field": b'{"model": "m", "prompt": ' + b"[" * 5000 + b"}",
    "lone_surrogate": b'{"model": "m", "prompt": "hi \\ud800 there", "max_tokens": 2}',
    "lone_surrogate_key": b'{"model": "m", "prompt": "hi", "\\udfff": 1}',
    "invalid_utf8": b'{"model": "m", "prompt": "caf\xe9 \xff\xfe"}',
    "huge_integer": b'{"model": "m", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    "not_an_object": b'[1, 2, 3]',
    "a_string": b'"prompt"',
    "truncated": b'{"model": "m", "prompt": "hi"',
    "empty": b"",
}


def is_openai_error(r) -> bool:
    doc = r.json()
    return set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"} \
        and isinstance(doc["error"]["message"], str)


def scrape(client) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(client.get("/metrics").text) for s in fam.samples}


def good_completion(r) -> bool:
    doc = r.json()
    return r.status_code == 200 and doc["object"] == "text_completion" and isinstance(doc["choices"][0]["text"], str)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("faults")
    with ServerThread(build_engine(tmp / "a", tokenizer)) as a, ServerThread(build_engine(tmp / "b", tokenizer)) as b:
        yield a, b


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_clients_bytes_a_backend_refuses_are_the_same_400_from_the_router_which_lives_on(pair, route) -> None:
    a, _ = pair
    with RouterThread(a.url) as router, router.client() as c, a.client() as direct:
        for name, body in HOSTILE.items():
            r = c.post(route, content=body, headers=JSON)
            d = direct.post(route, content=body, headers=JSON)
            assert (name, r.status_code, d.status_code) == (name, 400, 400), (r.text[:300], d.text[:300])
            assert is_openai_error(r) and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
            assert r.json()["error"]["message"] == d.json()["error"]["message"]       # the backend's words
        # Not JSON's media type: the backend's 415, not a 400 and not a 500.
        r = c.post(route, content=b"[" * 5000, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and is_openai_error(r)
        # A body the router parses but a backend refuses (a field): the backend's 400, relayed.
        r = c.post(route, json={"model": MODEL, "prompt": "hi", "messages": [], "max_tokens": "five"})
        assert r.status_code == 400 and is_openai_error(r)
        # The router lives on and serves.
        assert router.health()["backends_up"] == 1
        assert good_completion(complete(c, "After the hostile bytes, a question?"))
        assert c.get("/no/such/route").status_code == 404 and is_openai_error(c.get("/no/such/route"))


def test_a_backend_whose_cache_status_is_not_utf8_at_start_is_ejected_and_the_router_serves(pair) -> None:
    a, b = pair
    with FaultFront(b.url, mode="status_garbage") as front, RouterThread(a.url, front.url, **FAST) as router:
        view = router.backend_view(front.url)
        assert not view["healthy"] and view["ejected"], view
        assert "/v1/cache/status" in view["last_error"] and view["ejections"] == {"bad_status": 1}
        with router.client() as c:
            for i in range(4):
                r = complete(c, f"While one backend is broken, question {i}?")
                assert good_completion(r) and r.headers[BACKEND_HEADER] == a.url
            assert scrape(c)[("tieredkv_router_backend_ejected", (("backend", front.url),))] == 1
            # Still garbage later: its probes fail and it stays out.
            wait_for(lambda: router.backend_view(front.url)["probes"].get("failed", 0) >= 1, timeout=60,
                     what="a failed probe")
            assert router.backend_view(front.url)["ejected"]
            front.mode = "pass"
            wait_for(lambda: router.backend_view(front.url)["healthy"], timeout=60, what="readmission")
            view = router.backend_view(front.url)
            assert not view["ejected"] and view["readmissions"] == 1 and view["probes"]["passed"] == 1


@pytest.mark.parametrize("mode", ["garbage", "garbage_stream", "error_500"])
def test_one_backend_of_two_answering_garbage_costs_no_request_is_ejected_and_readmitted(pair, mode) -> None:
    a, b = pair
    stream = mode == "garbage_stream"
    with FaultFront(b.url, mode=mode) as front, RouterThread(a.url, front.url, **FAST) as router, \
            router.client() as c:
        assert router.health()["backends_up"] == 2            # its /health says 200: it looks up

        def one(i: int) -> tuple[bool, str]:
            body = {"model": MODEL, "prompt": f"Garbage run {mode}, question {i}?", "max_tokens": 4,
                    "temperature": 0, "user": f"t{i % 5}", "stream": stream}
            if not stream:
                r = c.post("/v1/completions", json=body)
                return good_completion(r), r.headers.get(BACKEND_HEADER, "")
            with c.stream("POST", "/v1/completions", json=body) as r:
                events = sse_events(r) if r.status_code == 200 else []
            ok = bool(events) and events[-1] == "[DONE]" and all("choices" in e for e in events[:-1])
            return ok, r.headers.get(BACKEND_HEADER, "")

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(100)))
        assert sum(ok for ok, _ in results) >= 95, results
        assert all(ok for ok, _ in results)                   # in fact every one: each retried before a byte
        assert {u for _, u in results} == {a.url}             # no answer came from the broken backend
        assert front.generation_requests >= 1                 # it was tried, and refused
        view = router.backend_view(front.url)
        assert view["ejected"] and not view["healthy"] and view["last_error"], view
        label = "http_500" if mode == "error_500" else "garbage"
        assert view["ejections"].get(label, 0) >= 1, view
        m = scrape(c)
        assert m[("tieredkv_router_ejections_total", (("backend", front.url), ("reason", label)))] >= 1
        assert m[("tieredkv_router_backend_ejected", (("backend", front.url),))] == 1
        assert sum(v for (name, _), v in m.items() if name == "tieredkv_router_failed_total") == 0
        # It recovers: a probe readmits it and it serves again.
        front.mode = "pass"
        wait_for(lambda: router.backend_view(front.url)["healthy"], timeout=60, what="readmission")
        served = [complete(c, f"After recovery, new prefix {i}?") for i in range(6)]
        assert all(good_completion(r) for r in served)
        assert front.url in {r.headers[BACKEND_HEADER] for r in served}
        m = scrape(c)
        assert m[("tieredkv_router_readmissions_total", (("backend", front.url),))] >= 1
        assert m[("tieredkv_router_probes_total", (("backend", front.url), ("outcome", "passed")))] >= 1


def test_the_last_backend_answering_garbage_gives_a_json_error_never_a_200(pair) -> None:
    _, b = pair
    with FaultFront(b.url, mode="garbage") as front, RouterThread(front.url, **FAST) as router, \
            router.client() as c:
        for i in range(2):
            r = complete(c, f"Only garbage here, question {i}?")
            assert r.status_code == 502 and is_openai_error(r), r.text[:200]
        # A request's garbage spares the last backend up (one poison request must not take the
        # fleet out), but never reaches a client; its third failure in a row ejects it too.
        view = router.backend_view(front.url)
        assert view["healthy"] and view["spared"] == 2 and "not a JSON object" in view["last_error"], view
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Streamed?", "max_tokens": 2, "stream": True})
        assert r.status_code == 502 and is_openai_error(r)
        assert router.backend_view(front.url)["ejected"]
        r = complete(c, "And now?")
        assert r.status_code == 503 and is_openai_error(r) and r.json()["error"]["code"] == "no_backend"
        assert c.get("/health").status_code == 503
        assert scrape(c)[("tieredkv_router_spared_total", (("backend", front.url),))] == 2
        front.mode = "pass"
        wait_for(lambda: router.backend_view(front.url)["healthy"], timeout=60, what="readmission")
        assert good_completion(complete(c, "Recovered?"))


def test_a_stream_that_breaks_after_its_first_event_ends_with_an_error_event_never_garbage(pair) -> None:
    _, b = pair
    with FaultFront(b.url, mode="stream_break") as front, RouterThread(front.url, **FAST) as router, \
            router.client() as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Break me?", "max_tokens": 8,
                                                       "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert front.faked == 1
        assert events[0]["object"] == "text_completion"                  # the good first event
        assert events[-1]["error"]["code"] == "backend_failed"            # then OpenAI's error event
        assert all(isinstance(e, dict) and ("choices" in e or "error" in e) for e in events)
        assert "stream" in router.backend_view(front.url)["last_error"]


def test_a_backend_that_hangs_is_ejected_on_its_timeout_and_costs_no_request(pair) -> None:
    a, b = pair
    with FaultFront(b.url, mode="hang") as front, \
            RouterThread(a.url, front.url, request_timeout_s=3.0, health_timeout_s=3.0, **FAST) as router, \
            router.client() as c:
        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(lambda i: complete(c, f"Hang run, question {i}?"), range(12)))
        assert all(good_completion(r) and r.headers[BACKEND_HEADER] == a.url for r in served)
        assert front.faked >= 1
        view = router.backend_view(front.url)
        assert view["ejected"] and view["ejections"].get("timeout", 0) >= 1 and "Timeout" in view["last_error"], view
        front.mode = "pass"
        wait_for(lambda: router.backend_view(front.url)["healthy"], timeout=60, what="readmission")
