"""Issue 29, item 2 over HTTP: n choices on /v1/completions and /v1/chat/completions (a real
server, the tiny engine): indexed choices, logprobs per choice, streamed with each choice's
index, the prompt billed once and the completions summed, --max-n's 400 (tests/service/test_errors.py)."""
from __future__ import annotations

from tests.service.conftest import check_usage, sse_events

PROMPT = "Three ways to say hello in another language"


def _body(engine, user, **kw):
    return {"model": engine.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "user": user, **kw}


def test_completions_n_choices_are_indexed_seeded_and_billed_once(client, engine):
    r = client.post("/v1/completions", json=_body(engine, "n-compl", n=3, logprobs=2))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 3          # distinct draws
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6 and lp["text_offset"][0] == 0
        assert "".join(lp["tokens"]) == c["text"]
    u = body["usage"]
    check_usage(u)
    prompt_tokens = len(engine.encode(PROMPT))
    assert (u["prompt_tokens"], u["completion_tokens"]) == (prompt_tokens, 18)
    bill = engine.ledger.tenant("n-compl")
    assert (bill.requests, bill.prompt_tokens, bill.completion_tokens) == (1, prompt_tokens, 18)
    again = client.post("/v1/completions", json=_body(engine, "n-compl", n=3, logprobs=2)).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]     # seeded


def test_chat_n_choices_stream_with_their_index_and_one_usage(client, engine):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 2, "user": "n-chat",
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert all(len(c["choices"]) == 1 for c in chunks)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    text = {i: "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
            for i in (0, 1)}
    finishes = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length")
    assert finishes == [0, 1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    check_usage(final["usage"])
    # The same request unstreamed gives the same choices.
    whole = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert {c["index"]: c["message"]["content"] for c in whole["choices"]} == text
