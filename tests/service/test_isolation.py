"""Issue 8, item 2, through the real HTTP server: one tenant's request never fails another's.

The issue's reproduction: a user-role tenant sends temperature=1e-38 / top_p=1e-46 while another
tenant has JSON and SSE requests in flight. Before, the sampler produced NaN probabilities and
the engine failed the whole batch: the other tenant's four requests became 500s (or SSE error
events) and the hostile request was not billed. Now every request completes and is billed.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, check_usage, write_keys
from tests.service.tiny_engine import build_engine

ACME, MALLORY = "sk-acme-0001", "sk-mallory-0001"
KEYS = {ACME: {"tenant": "acme", "role": "user"}, MALLORY: {"tenant": "mallory", "role": "user"}}
VICTIM_TOKENS = 160


@pytest.fixture
def keyed(tmp_path, tokenizer):
    settings = ServiceSettings(api_keys_file=write_keys(tmp_path / "keys.json", KEYS))
    with ServerThread(build_engine(tmp_path, tokenizer), settings) as s:
        yield s


def test_a_tenants_extreme_sampling_fails_none_of_another_tenants_requests(keyed):
    engine = keyed.engine
    model = engine.model_name
    results: dict[str, object] = {}
    last_event_at: list[float] = []

    def victim(name: str, stream: bool, chat: bool) -> None:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": model, "max_tokens": VICTIM_TOKENS, "temperature": 0, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Victim request {name}: tell a long story"}]
        else:
            body["prompt"] = f"Victim request {name}: the tiered cache keeps serving while"
        if stream:
            body["stream_options"] = {"include_usage": True}
        try:
            with keyed.client(headers={"Authorization": f"Bearer {ACME}"}) as c:
                if not stream:
                    r = c.post(route, json=body)
                    results[name] = (r.status_code, r.json())
                    return
                with c.stream("POST", route, json=body) as r:
                    events = []
                    for line in r.iter_lines():
                        if line:
                            last_event_at.append(time.monotonic())
                            events.append(line)
                    results[name] = (r.status_code, events)
        except Exception as e:         # asserted on below
            results[name] = e

    victims = [threading.Thread(target=victim, args=(n, s, ch))
               for n, s, ch in [("json", False, False), ("json-chat", False, True),
                                ("sse", True, False), ("sse-chat", True, True)]]
    for t in victims:
        t.start()
    deadline = time.monotonic() + 60
    while len(engine.scheduler.running) < 4:          # all four are decoding now
        assert time.monotonic() < deadline, "the victim requests never ran together"
        time.sleep(0.002)

    hostile = [{"temperature": 1e-38}, {"temperature": 0.7, "top_p": 1e-46, "seed": 1},
               {"temperature": 1e-38, "top_p": 1e-46}]
    with keyed.client(headers={"Authorization": f"Bearer {MALLORY}"}) as c:
        answers = [c.post("/v1/completions", json={"model": model, "prompt": "Mallory's request", "max_tokens": 6,
                                                   **h}) for h in hostile]
    hostile_done_at = time.monotonic()
    for t in victims:
        t.join(120)

    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        check_usage(r.json()["usage"])
    # The hostile requests ran while the victims were decoding (not before, not after).
    assert max(last_event_at) > hostile_done_at
    for name in ("json", "json-chat"):
        status, body = results[name]
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        check_usage(body["usage"])
    for name in ("sse", "sse-chat"):
        status, lines = results[name]
        assert status == 200, lines
        payloads = [ln[len("data: "):] for ln in lines]
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert not any("error" in ch for ch in chunks), chunks
        assert any(c["choices"] and c["choices"][0].get("finish_reason") in ("length", "stop") for c in chunks)
        check_usage(chunks[-1]["usage"])

    # Every request billed, the hostile ones included (the issue: the hostile one was not).
    with keyed.client(headers={"Authorization": f"Bearer {MALLORY}"}) as c:
        assert c.get("/v1/cache/billing").json()["requests"] == len(hostile)
    with keyed.client(headers={"Authorization": f"Bearer {ACME}"}) as c:
        assert c.get("/v1/cache/billing").json()["requests"] == 4
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages
