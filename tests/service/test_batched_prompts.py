"""Issue 29, item 3 over HTTP: `prompt` as a list on /v1/completions (a real server, the tiny
engine), as OpenAI and vLLM take it: a list of strings or of token-id lists, one choice per
prompt and choice, indexed prompt-major (index = prompt_index * n + choice), each prompt billed
as its own request, the response's usage their sum; streamed too, one id for the response."""
from __future__ import annotations

from tests.service.conftest import check_usage, sse_events

PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village by the sea,"]


def _body(engine, user, prompt, **kw):
    return {"model": engine.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "user": user, **kw}


def test_a_batch_of_strings_answers_every_prompt_in_order_with_usage_summed(client, engine):
    r = client.post("/v1/completions", json=_body(engine, "batch-str", PROMPTS, n=2, logprobs=1))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert r.headers["x-request-id"] == body["id"]
    for i, prompt in enumerate(PROMPTS):     # each prompt's choices are those of the prompt sent alone
        alone = client.post("/v1/completions", json=_body(engine, "batch-str-alone", prompt, n=2)).json()
        assert [c["text"] for c in body["choices"][i * 2:i * 2 + 2]] == [c["text"] for c in alone["choices"]]
    for c in body["choices"]:
        assert c["finish_reason"] == "length" and "".join(c["logprobs"]["tokens"]) == c["text"]
    u = body["usage"]
    check_usage(u)
    prompt_tokens = sum(len(engine.encode(p)) for p in PROMPTS)
    assert (u["prompt_tokens"], u["completion_tokens"]) == (prompt_tokens, 16)
    bill = engine.ledger.tenant("batch-str")       # two requests, billed what the response says
    assert (bill.requests, bill.prompt_tokens, bill.completion_tokens) == (2, prompt_tokens, 16)
    assert bill.miss_tokens == u["prompt_cache_miss_tokens"]


def test_a_batch_of_token_lists_streams_each_choice_with_its_index_and_one_usage(client, engine):
    ids = [engine.encode(p) for p in PROMPTS] + [engine.encode(PROMPTS[0])[:3]]
    body = _body(engine, "batch-ids", ids, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert {c["id"] for c in chunks} == {final["id"]}                       # one id for the response
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    finishes = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length")
    assert finishes == [0, 1, 2]
    u = final["usage"]
    check_usage(u)
    assert final["choices"] == [] and (u["prompt_tokens"], u["completion_tokens"]) == (sum(map(len, ids)), 12)
    # The same batch unstreamed gives the same choices (seeded).
    whole = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert {c["index"]: c["text"] for c in whole["choices"]} == text
    assert whole["usage"]["prompt_tokens"] == u["prompt_tokens"]
    assert engine.ledger.tenant("batch-ids").requests == 6


def test_a_batch_item_that_cannot_run_is_a_400_and_nothing_runs(client, engine):
    for prompt, param in ((["ok", ""], "prompt"), ([[1, 2], [10**9]], "prompt"), (["a", [1]], "prompt")):
        r = client.post("/v1/completions", json=_body(engine, "batch-bad", prompt))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert engine.ledger.tenant("batch-bad").requests == 0
