"""Issue 17, item 4 -- nothing a request asks for is silently ignored: the sampling fields vLLM
users rely on are honoured end to end, every other field is refused naming it (or, in lenient
mode, ignored out loud), keys are valid Unicode, bodies are JSON, and an oversize prompt is
refused before anything tokenizes it."""
from __future__ import annotations

import json
import logging

import openai
import pytest

from engine.sampling_params import SamplingParams
from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, sse_events

COMPL, CHAT, LOOKUP, FLUSH = "/v1/completions", "/v1/chat/completions", "/v1/cache/lookup", "/v1/cache/flush"
OK_CHAT = [{"role": "user", "content": "hi"}]
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill"
REPEATS = "hello hello hello hello"       # the tiny model's greedy output repeats a token at step 52
HEADER = "X-Tieredkv-Ignored-Fields"


def body_for(path, served, /, **extra):
    base = {COMPL: {"model": served, "prompt": "x", "max_tokens": 1},
            CHAT: {"model": served, "messages": OK_CHAT, "max_tokens": 1},
            LOOKUP: {"prompt": "x"}, FLUSH: {}}[path]
    return {**base, **extra}


def post(client, path, body, **kw):
    return client.post(path, json=body, **kw)


def generate(client, model, path=COMPL, **kw):
    body = ({"model": model, "prompt": TEXT} if path == COMPL else
            {"model": model, "messages": [{"role": "user", "content": TEXT}]})
    r = client.post(path, json={**body, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["text"] if path == COMPL else choice["message"]["content"]), choice["finish_reason"], \
        r.json()["usage"]


# ---- the sampling fields, end to end -------------------------------------------------------

def test_stop_token_ids_stop_there_with_finish_reason_stop(client, engine):
    for path in (COMPL, CHAT):
        prompt = TEXT if path == COMPL else engine.apply_chat_template([{"role": "user", "content": TEXT}])
        ids = engine.generate(prompt, SamplingParams(max_tokens=8)).token_ids
        stop = ids[3]
        want = engine.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop]))
        assert want.finish_reason == "stop" and want.token_ids == ids[:ids.index(stop) + 1]
        text, reason, usage = generate(client, engine.model_name, path, max_tokens=8, stop_token_ids=[stop])
        assert reason == "stop" and usage["completion_tokens"] == ids.index(stop) + 1
        # As vLLM: the stop token's own text is left out, unless include_stop_str_in_output.
        assert text == want.text == engine.tokenizer.decode(ids[:ids.index(stop)], skip_special_tokens=True)
        text, reason, _ = generate(client, engine.model_name, path, max_tokens=8, stop_token_ids=[stop],
                                   include_stop_str_in_output=True)
        assert reason == "stop" and text == engine.tokenizer.decode(ids[:ids.index(stop) + 1])


def test_min_tokens_keeps_generating_past_a_stop_token(client, engine):
    ids = engine.generate(TEXT, SamplingParams(max_tokens=10)).token_ids
    stop = ids[1]
    _, reason, usage = generate(client, engine.model_name, max_tokens=10, stop_token_ids=[stop])
    assert reason == "stop" and usage["completion_tokens"] == ids.index(stop) + 1
    text, reason, usage = generate(client, engine.model_name, max_tokens=10, stop_token_ids=[stop], min_tokens=6)
    assert usage["completion_tokens"] >= 6
    want = engine.generate(TEXT, SamplingParams(max_tokens=10, stop_token_ids=[stop], min_tokens=6))
    assert stop not in want.token_ids[:6]
    assert (text, reason, usage["completion_tokens"]) == (want.text, want.finish_reason, len(want.token_ids))


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.3), ("frequency_penalty", 1.0),
                                         ("presence_penalty", 1.0), ("frequency_penalty", -2.0)])
def test_penalties_change_greedy_output_as_the_engine_does(client, engine, field, value):
    plain = engine.generate(REPEATS, SamplingParams(max_tokens=64))
    want = engine.generate(REPEATS, SamplingParams(max_tokens=64, **{field: value}))
    assert want.token_ids != plain.token_ids
    r = client.post(COMPL, json={"model": engine.model_name, "prompt": REPEATS, "max_tokens": 64, "temperature": 0,
                                 field: value})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text
    plain_text = client.post(COMPL, json={"model": engine.model_name, "prompt": REPEATS, "max_tokens": 64,
                                          "temperature": 0}).json()["choices"][0]["text"]
    assert plain_text == plain.text != want.text
    # The chat route maps the field too.
    chat_ids = engine.apply_chat_template([{"role": "user", "content": REPEATS}])
    want_chat = engine.generate(chat_ids, SamplingParams(max_tokens=64, **{field: value}))
    text, _, _ = generate(client, engine.model_name, CHAT, messages=[{"role": "user", "content": REPEATS}],
                          max_tokens=64, **{field: value})
    assert text == want_chat.text


def test_min_p_1_with_temperature_is_greedy(client, engine):
    greedy, _, _ = generate(client, engine.model_name, max_tokens=10)
    for seed in (1, 2):
        sampled, _, _ = generate(client, engine.model_name, max_tokens=10, temperature=1.0, min_p=1.0, seed=seed)
        assert sampled == greedy
    assert any(generate(client, engine.model_name, max_tokens=10, temperature=1.0, seed=s)[0] != greedy for s in (1, 2))


def test_include_stop_str_in_output_keeps_the_stop_string(client, engine):
    text, _, _ = generate(client, engine.model_name, max_tokens=12)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    cut, reason, _ = generate(client, engine.model_name, max_tokens=12, stop=[stop])
    assert reason == "stop" and cut == text[:text.index(stop)]
    kept, reason, _ = generate(client, engine.model_name, max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    assert reason == "stop" and kept == text[:text.index(stop) + len(stop)]
    body = {"model": engine.model_name, "prompt": TEXT, "temperature": 0, "max_tokens": 12, "stop": [stop],
            "include_stop_str_in_output": True, "stream": True}
    with client.stream("POST", COMPL, json=body) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == kept


def test_max_completion_tokens_is_max_tokens_on_both_routes(client, engine):
    for path in (COMPL, CHAT):
        _, reason, usage = generate(client, engine.model_name, path, max_completion_tokens=3)
        assert (reason, usage["completion_tokens"]) == ("length", 3)
        _, _, usage = generate(client, engine.model_name, path, max_completion_tokens=4, max_tokens=4)
        assert usage["completion_tokens"] == 4


def test_the_openai_client_sends_the_new_fields(server, engine):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as oai:
        ids = engine.generate(TEXT, SamplingParams(max_tokens=8)).token_ids
        r = oai.completions.create(model=engine.model_name, prompt=TEXT, max_tokens=8, temperature=0,
                                   frequency_penalty=0.5, presence_penalty=0.5,
                                   extra_body={"stop_token_ids": [ids[4]], "min_tokens": 2, "repetition_penalty": 1.1})
        want = engine.generate(TEXT, SamplingParams(max_tokens=8, stop_token_ids=[ids[4]], min_tokens=2,
                                                    repetition_penalty=1.1, frequency_penalty=0.5,
                                                    presence_penalty=0.5))
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason)
        c = oai.chat.completions.create(model=engine.model_name, messages=OK_CHAT, max_completion_tokens=3,
                                        temperature=0, store=False, user="t-oai-fields")
        assert c.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=engine.model_name, messages=OK_CHAT, max_tokens=2,
                                        extra_body={"use_beam_search": True})
        assert e.value.body["param"] == "use_beam_search"
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=engine.model_name, messages=OK_CHAT, max_tokens=2, reasoning_effort="low")
        assert e.value.body["param"] == "reasoning_effort"


# ---- unknown and refused fields ------------------------------------------------------------

UNKNOWN = [
    (COMPL, {"foo": 1}, "foo"),
    (CHAT, {"foo": None}, "foo"),
    (COMPL, {"use_beam_search": True}, "use_beam_search"),
    (COMPL, {"response_format": {"type": "text"}}, "response_format"),     # a chat field, not a completions one
    (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    (COMPL, {"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    (LOOKUP, {"model": "m"}, "model"),
    (FLUSH, {"everything": True}, "everything"),
]


@pytest.mark.parametrize("path,extra,name", UNKNOWN, ids=[u[2] for u in UNKNOWN])
def test_an_unknown_field_is_refused_in_openais_words(client, engine, path, extra, name):
    r = post(client, path, body_for(path, engine.model_name, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"Unrecognized request argument supplied: {name}",
                                 "type": "invalid_request_error", "param": name, "code": None}


REFUSED = [
    (COMPL, "guided_json", {"type": "object"}), (CHAT, "guided_choice", ["a", "b"]), (COMPL, "guided_regex", "a+"),
    (CHAT, "structured_outputs", {"choice": ["a"]}), (CHAT, "reasoning_effort", "low"),
    (CHAT, "metadata", {"k": "v"}), (CHAT, "store", True), (CHAT, "service_tier", "flex"),
    (COMPL, "logit_bias", {"5": 10}), (CHAT, "logit_bias", {"5": -100}), (CHAT, "tools", [{"type": "function"}]),
    (CHAT, "web_search_options", {}), (COMPL, "echo", True), (COMPL, "best_of", 2),
]


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "lenient"])
def test_a_known_field_that_cannot_be_honoured_is_refused_either_way(engine, lenient):
    settings = ServiceSettings(unknown_fields="ignore" if lenient else "reject", close_engine_on_shutdown=False)
    with ServerThread(engine, settings) as s, s.client() as c:
        for path, name, value in REFUSED:
            r = post(c, path, body_for(path, engine.model_name, **{name: value}))
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["param"] == name and err["message"].startswith(f"{name}: "), err
            assert HEADER not in r.headers


def test_harmless_fields_are_accepted(client, engine):
    for path, extra in ((COMPL, {"user": "t-harmless", "seed": 5, "n": 1, "best_of": 1, "echo": False,
                                 "suffix": None, "logit_bias": {}, "ignore_eos": False}),
                        (CHAT, {"user": "t-harmless", "seed": 5, "store": False, "metadata": None, "tools": [],
                                "tool_choice": "none", "response_format": {"type": "text"}, "n": 1})):
        r = post(client, path, body_for(path, engine.model_name, **extra))
        assert r.status_code == 200, r.text
        assert HEADER not in r.headers


def test_lenient_mode_ignores_unknown_fields_out_loud(engine, caplog):
    settings = ServiceSettings(unknown_fields="ignore", close_engine_on_shutdown=False)
    caplog.set_level(logging.WARNING, logger="tieredkv.service")
    with ServerThread(engine, settings) as s, s.client() as c:
        body = body_for(COMPL, engine.model_name, foo=1, use_beam_search=True, **{"a,b": 2, "é": 3})
        for _ in range(2):
            r = post(c, COMPL, body)
            assert r.status_code == 200, r.text
            assert set(r.headers[HEADER].split(",")) == {"foo", "use_beam_search", "a%2Cb", "%C3%A9"}
        chat = body_for(CHAT, engine.model_name, messages=[{"role": "user", "content": "hi", "refusal": None}],
                        stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
        with c.stream("POST", CHAT, json=chat) as r:
            assert r.status_code == 200 and set(r.headers[HEADER].split(",")) == {
                "messages[0].refusal", "stream_options.include_obfuscation"}
            assert sse_events(r)[-1] == "[DONE]"
        r = post(c, LOOKUP, {"prompt": "x", "model": "m"})
        assert r.status_code == 200 and r.headers[HEADER] == "model"
        # A request without unknown fields has no header; a bad known field is still a 400.
        assert HEADER not in post(c, COMPL, body_for(COMPL, engine.model_name)).headers
        r = post(c, COMPL, body_for(COMPL, engine.model_name, foo=1, max_tokens="2"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # The OpenAPI document no longer claims that unknown fields are refused.
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        assert "additionalProperties" not in schemas["CompletionRequest"] and \
            "additionalProperties" not in schemas["ChatMessage"]
    warned = [rec.getMessage() for rec in caplog.records if "unrecognized request field" in rec.getMessage()]
    assert sum("'foo'" in m for m in warned) == 1        # once per name, however often it is sent
    assert any("'\\xe9'" in m for m in warned)


def test_settings_validate_the_new_knobs():
    for kw in ({"unknown_fields": "warn"}, {"max_prompt_bytes": 0}, {"max_prompt_bytes": "1MB"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ServiceSettings(**kw)


# ---- keys that are not valid Unicode -------------------------------------------------------

SURROGATE_KEY = [
    (COMPL, b'{"\\ud800": 1}', "'\\\\ud800'"),
    (COMPL, b'{"model": "m", "prompt": "x", "\\udfff": "y"}', "'\\\\udfff'"),
    (CHAT, b'{"\\ud800": 1}', "'\\\\ud800'"),
    (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
     "messages[0].'\\\\ud800'"),
    (LOOKUP, b'{"\\ud800": 1}', "'\\\\ud800'"),
    (FLUSH, b'{"\\ud800": "\\ud800"}', "'\\\\ud800'"),
]


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "lenient"])
def test_a_key_that_is_a_lone_surrogate_is_a_400_shown_escaped(engine, lenient):
    settings = ServiceSettings(unknown_fields="ignore" if lenient else "reject", close_engine_on_shutdown=False)
    with ServerThread(engine, settings) as s, s.client() as c:
        for path, raw, param in SURROGATE_KEY:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, raw, r.text)
            r.content.decode("utf-8")                      # valid UTF-8: no raw surrogate in it
            err = r.json()["error"]
            assert err["param"] == json.loads(f'"{param}"') and "not valid Unicode" in err["message"], err
            assert "\ud800" not in r.text and "\udfff" not in r.text


# ---- the body must be JSON -----------------------------------------------------------------

def test_a_body_must_be_sent_as_json(client, engine):
    for path in (COMPL, CHAT, LOOKUP, FLUSH):
        raw = json.dumps(body_for(path, engine.model_name)).encode()
        for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = client.post(path, content=raw, headers={} if ctype is None else {"content-type": ctype})
            assert r.status_code == 415, (path, ctype, r.text)
            err = r.json()["error"]
            assert err["message"].startswith("Content-Type must be application/json")
            assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"
        for ctype in ("application/json; charset=utf-8", "Application/JSON"):
            r = client.post(path, content=raw, headers={"content-type": ctype})
            assert r.status_code == 200, (path, ctype, r.text)
    # Flush's body is optional: none at all needs no type.
    assert client.post(FLUSH).status_code == 200


# ---- prompts too big to be worth tokenizing ------------------------------------------------

@pytest.fixture
def no_tokenizing(engine, monkeypatch):
    """Counts the engine's tokenizing calls (text prompts and chat templates)."""
    calls = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_an_oversize_prompt_is_refused_before_it_is_tokenized(client, engine, no_tokenizing):
    limit = 32 * engine.max_context
    big = [("x" * (limit + 1)), ("é" * (limit // 2 + 1))]       # the second: fewer chars than bytes
    for prompt in big:
        for path, body in ((COMPL, {"model": engine.model_name, "prompt": prompt}),
                           (LOOKUP, {"prompt": prompt}),
                           (CHAT, {"model": engine.model_name, "messages": [
                               {"role": "system", "content": prompt[:len(prompt) // 2]},
                               {"role": "user", "content": prompt[len(prompt) // 2:]}]}),
                           (LOOKUP, {"messages": [{"role": "user", "content": prompt}]})):
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text[:300])
            err = r.json()["error"]
            field = "prompt" if "prompt" in body else "messages"
            assert err["param"] == field and f"more than {limit} bytes" in err["message"], err
    ids = [1] * (engine.max_context * 50)
    for path, body in ((COMPL, {"model": engine.model_name, "prompt": ids}), (LOOKUP, {"prompt": ids})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert f"context of {engine.max_context} tokens" in r.json()["error"]["message"]
    assert no_tokenizing == []
    # Just under the bound, a prompt is tokenized (and refused by its token count instead).
    r = client.post(COMPL, json={"model": engine.model_name, "prompt": "x" * limit, "max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"] and no_tokenizing == ["encode"]


def test_max_prompt_bytes_setting(engine):
    with ServerThread(engine, ServiceSettings(max_prompt_bytes=100, close_engine_on_shutdown=False)) as s, \
            s.client() as c:
        assert c.post(COMPL, json={"model": engine.model_name, "prompt": "a" * 100, "max_tokens": 1}).status_code == 200
        r = c.post(COMPL, json={"model": engine.model_name, "prompt": "a" * 101, "max_tokens": 1})
        assert r.status_code == 400 and "max_prompt_bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_temperature_is_bounded_by_openais_range(client, engine, route) -> None:
    body = {"model": engine.model_name, "max_tokens": 1,
            **({"prompt": "x"} if route.endswith("/completions") and "chat" not in route
               else {"messages": [{"role": "user", "content": "x"}]})}
    r = client.post(route, json={**body, "temperature": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    assert client.post(route, json={**body, "temperature": 2}).status_code == 200
