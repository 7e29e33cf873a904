"""OpenAI-compatible routes on a real server: shapes, streaming, usage and cache hits, concurrency."""
from __future__ import annotations

import json
import threading

import openai
import pytest

from engine.sampling_params import SamplingParams
from tests.service.conftest import check_usage, sse_events
from tests.service.tiny_engine import BLOCK_SIZE

TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill"


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def completion(client, model, prompt, **kw):
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    check_usage(r.json()["usage"])
    return r.json()


def test_models(client, oai, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [engine.model_name]
    assert [m.id for m in oai.models.list()] == [engine.model_name]
    assert oai.models.retrieve(engine.model_name).id == engine.model_name
    assert client.get("/health").json()["status"] == "ok"


def test_completion_matches_the_engine(oai, engine):
    r = oai.completions.create(model=engine.model_name, prompt=TEXT, max_tokens=5, temperature=0, user="t-compl")
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == engine.model_name
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    want = engine.generate(TEXT, SamplingParams(max_tokens=5), tenant="t-compl-direct")
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == len(want.prompt_token_ids)
    check_usage(r.usage.model_dump())


def test_token_id_prompt_equals_text_prompt(client, engine, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    by_text = completion(client, engine.model_name, TEXT, max_tokens=6, user="t-ids")
    by_ids = completion(client, engine.model_name, ids, max_tokens=6, user="t-ids")
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)


def test_repeated_prompt_gets_device_hits(client, engine, tokenizer):
    ids = tokenizer(TEXT + " and again")["input_ids"]
    n = len(ids)
    first = completion(client, engine.model_name, ids, max_tokens=3, user="t-repeat")["usage"]
    assert (first["prompt_cache_hit_tokens"], first["prompt_cache_miss_tokens"]) == (0, n)
    second = completion(client, engine.model_name, ids, max_tokens=3, user="t-repeat")["usage"]
    hit = (n - 1) // BLOCK_SIZE * BLOCK_SIZE         # full blocks, capped at n - 1 tokens
    assert second["prompt_cache_hit_tokens_by_tier"] == {"device": hit, "host": 0, "disk": 0, "remote": 0}
    assert second["prompt_cache_miss_tokens"] == n - hit
    assert second["prompt_tokens_details"]["cached_tokens"] == hit
    # Another tenant shares no cache with this one: its salt differs.
    other = completion(client, engine.model_name, ids, max_tokens=3, user="t-repeat-other")["usage"]
    assert other["prompt_cache_hit_tokens"] == 0


def test_chat_matches_the_engine(oai, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = oai.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    want = engine.generate(engine.apply_chat_template(messages), SamplingParams(max_tokens=6), tenant="chat-direct")
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    check_usage(r.usage.model_dump())


def test_stream_completion_with_usage(client, engine):
    body = {"model": engine.model_name, "prompt": TEXT, "max_tokens": 7, "temperature": 0, "user": "t-stream"}
    whole = completion(client, engine.model_name, TEXT, max_tokens=7, user="t-stream")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks + [final]}) == 1
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert final["choices"] == []
    check_usage(final["usage"])
    assert final["usage"]["completion_tokens"] == 7
    # The same prompt again, so its full blocks are device hits.
    assert final["usage"]["prompt_cache_hit_tokens_by_tier"]["device"] == \
        (whole["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_stream_without_usage_has_no_usage_field(client, engine):
    body = {"model": engine.model_name, "prompt": TEXT, "max_tokens": 3, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and len(e["choices"]) == 1 for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_chat_with_the_openai_client(oai, engine):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = oai.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=8, temperature=0)
    chunks = list(oai.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=8,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage.model_dump()
    assert chunks[-1].choices == []
    check_usage(usage)
    assert usage["prompt_tokens"] == whole.usage.prompt_tokens and usage["completion_tokens"] == 8
    assert usage["prompt_cache_hit_tokens"] > 0          # the same chat twice


def test_stop_string_cuts_the_text(client, engine):
    text = completion(client, engine.model_name, TEXT, max_tokens=12)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    got = completion(client, engine.model_name, TEXT, max_tokens=12, stop=[stop, "\x00never"])["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["text"] == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible(client, engine):
    runs = [completion(client, engine.model_name, TEXT, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
            for _ in range(2)]
    assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"]


def test_32_concurrent_clients_match_serial_runs(server, engine):
    prompts = [f"Request number {i}: {TEXT[: 20 + i]}" for i in range(32)]
    with server.client() as c:
        serial = [completion(c, engine.model_name, p, max_tokens=6, user="t-conc")["choices"][0]["text"] for p in prompts]
    results: dict[int, object] = {}

    def work(i: int) -> None:
        try:
            with server.client() as c:
                r = c.post("/v1/completions", json={"model": engine.model_name, "prompt": prompts[i],
                                                    "max_tokens": 6, "temperature": 0, "user": "t-conc"})
                results[i] = (r.status_code, r.json())
        except Exception as e:          # reported below, with the index
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(32))
    for i, res in results.items():
        assert isinstance(res, tuple) and res[0] == 200, (i, res)
        check_usage(res[1]["usage"])
        assert res[1]["choices"][0]["text"] == serial[i], i


# Issue 7, item 9: log-probabilities are honoured (the engine computes them), in OpenAI's shapes.

def _names(tokenizer, ids):
    return tokenizer.batch_decode([[i] for i in ids])


def test_completion_logprobs_are_the_engines(client, engine, tokenizer):
    lp = completion(client, engine.model_name, TEXT, max_tokens=5, logprobs=3, user="t-lp")["choices"][0]["logprobs"]
    want = engine.generate(TEXT, SamplingParams(max_tokens=5, logprobs=3), tenant="t-lp-direct")
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == _names(tokenizer, want.token_ids)
    assert lp["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-4)
    assert [list(d) for d in lp["top_logprobs"]] == [_names(tokenizer, [i for i, _ in s]) for s in want.logprobs]
    assert [list(d.values()) for d in lp["top_logprobs"]] == \
        [pytest.approx([x for _, x in s], abs=1e-4) for s in want.logprobs]
    # Greedy: the sampled token is the likeliest one.
    assert [max(d.values()) for d in lp["top_logprobs"]] == pytest.approx(lp["token_logprobs"], abs=1e-6)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]


def test_completion_logprobs_0_give_the_sampled_tokens_own(client, engine, tokenizer):
    # Sampled at temperature 1 on the random tiny model, a token is rarely the likeliest one: its
    # own log-probability is reported, not the top token's.
    got = completion(client, engine.model_name, TEXT, max_tokens=6, logprobs=0, temperature=1.0, seed=11)
    lp = got["choices"][0]["logprobs"]
    want = engine.generate(TEXT, SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=1))
    assert lp["tokens"] == _names(tokenizer, want.token_ids)
    assert lp["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-4)
    assert lp["top_logprobs"] == [{t: x} for t, x in zip(lp["tokens"], lp["token_logprobs"])]
    assert any(x < s[0][1] - 1e-3 for x, s in zip(want.token_logprobs, want.logprobs))


def test_streamed_completion_logprobs_equal_the_whole(client, engine):
    kw = {"max_tokens": 6, "logprobs": 2, "user": "t-lp-stream"}
    whole = completion(client, engine.model_name, TEXT, **kw)["choices"][0]["logprobs"]
    body = {"model": engine.model_name, "prompt": TEXT, "temperature": 0, "stream": True, **kw}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [e["choices"][0]["logprobs"] for e in sse_events(r)[:-1]]
    assert all(c is not None for c in chunks)
    joined = {k: [x for c in chunks for x in c[k]] for k in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-4)
    assert [list(d) for d in joined["top_logprobs"]] == [list(d) for d in whole["top_logprobs"]]


def test_chat_logprobs_with_the_openai_client(oai, engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = {"model": engine.model_name, "messages": messages, "max_tokens": 5, "temperature": 0}
    r = oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    want = engine.generate(engine.apply_chat_template(messages), SamplingParams(max_tokens=5, logprobs=2))
    assert len(content) == r.usage.completion_tokens == 5
    assert [e.logprob for e in content] == pytest.approx(want.token_logprobs, abs=1e-4)
    for e, top in zip(content, want.logprobs):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([x for _, x in top], abs=1e-4)
        assert e.token == e.top_logprobs[0].token and bytes(e.bytes).decode() == e.token
    streamed = [e for c in oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # logprobs alone: no top list; not asked: null.
    assert [e.top_logprobs for e in oai.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content] == \
        [[]] * 5
    assert oai.chat.completions.create(**kw).choices[0].logprobs is None


def test_logprobs_that_are_not_finite_are_sent_as_valid_json():
    # log_softmax gives -inf for a token whose logit is -inf; JSON has no -inf or NaN.
    from types import SimpleNamespace
    from service.responses import LOGPROB_FLOOR, Logprobs
    out = SimpleNamespace(token_ids=[5], token_logprobs=[float("-inf")], logprobs=[[(7, float("nan")), (5, float("-inf"))]])
    for chat in (False, True):
        body = Logprobs(None, 2, chat=chat).of(out)
        json.dumps(body, allow_nan=False)
        assert LOGPROB_FLOOR in (body["token_logprobs"] if not chat else [body["content"][0]["logprob"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_completions_bill_is_found_under_the_id_its_body_and_header_carry(client, engine, stream):
    """One id per request, the ledger included: an operator who greps the bills for a chat
    response's `chatcmpl-...` id finds its bill (it was recorded under the engine's `cmpl-` id)."""
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": f"which id is mine? {stream}"}],
            "max_tokens": 2,
            "user": "ids"}
    if stream:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [e for e in sse_events(r) if isinstance(e, dict)]
            header = r.headers["x-request-id"]
        body_id = events[0]["id"]
        assert {e.get("id") for e in events} == {body_id}, events
    else:
        r = client.post("/v1/chat/completions", json=body)
        body_id, header = r.json()["id"], r.headers["x-request-id"]
    assert body_id.startswith("chatcmpl-") and header == body_id
    assert engine.ledger.has(body_id), "the bill is not recorded under the id the client was given"
