"""Every failure gets OpenAI's error body and the right status; none stops the server."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from service.settings import ServiceSettings
from tests.service.conftest import ServerThread
from tests.service.tiny_engine import build_engine

M = "<model>"      # replaced by the served model's name
COMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
LONG = 300        # tokens: long enough to still be running when the test acts

CASES = [
    # (id, method, path, json body or raw bytes, status, param, code)
    ("malformed-json", "POST", COMPL, b"{bad", 400, None, "invalid_json"),
    ("not-an-object", "POST", COMPL, b"[1, 2]", 400, None, None),
    ("no-model", "POST", COMPL, {"prompt": "x"}, 400, "model", None),
    ("no-prompt", "POST", COMPL, {"model": M}, 400, "prompt", None),
    ("prompt-int", "POST", COMPL, {"model": M, "prompt": 5}, 400, "prompt", None),
    ("prompt-batch-mixed", "POST", COMPL, {"model": M, "prompt": ["a", [1]]}, 400, "prompt", None),
    ("prompt-batch-empty-item", "POST", COMPL, {"model": M, "prompt": ["a", ""]}, 400, "prompt", None),
    ("prompt-batch-lookup", "POST", "/v1/cache/lookup", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("prompt-empty", "POST", COMPL, {"model": M, "prompt": ""}, 400, "prompt", None),
    ("prompt-no-ids", "POST", COMPL, {"model": M, "prompt": []}, 400, "prompt", None),
    ("out-of-vocab", "POST", COMPL, {"model": M, "prompt": [1, 10**9]}, 400, "prompt", None),
    ("negative-id", "POST", COMPL, {"model": M, "prompt": [-1]}, 400, "prompt", None),
    ("too-long", "POST", COMPL, {"model": M, "prompt": [1] * 1024}, 400, "prompt", None),
    ("max-tokens-str", "POST", COMPL, {"model": M, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("max-tokens-0", "POST", COMPL, {"model": M, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("temperature-neg", "POST", COMPL, {"model": M, "prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("top-p-0", "POST", COMPL, {"model": M, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("top-p-str", "POST", COMPL, {"model": M, "prompt": "x", "top_p": "high"}, 400, "top_p", None),
    ("stop-ints", "POST", COMPL, {"model": M, "prompt": "x", "stop": [1]}, 400, "stop", None),
    ("seed-str", "POST", COMPL, {"model": M, "prompt": "x", "seed": "x"}, 400, "seed", None),
    ("n-above-max-n", "POST", COMPL, {"model": M, "prompt": "x", "n": 17}, 400, "n", None),
    ("n-0", "POST", COMPL, {"model": M, "prompt": "x", "n": 0}, 400, "n", None),
    ("stream-str", "POST", COMPL, {"model": M, "prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("logprobs-21", "POST", COMPL, {"model": M, "prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("logprobs-bool", "POST", COMPL, {"model": M, "prompt": "x", "logprobs": True}, 400, "logprobs", None),
    ("user-empty", "POST", COMPL, {"model": M, "prompt": "x", "user": ""}, 400, "user", None),
    ("user-too-long", "POST", COMPL, {"model": M, "prompt": "x", "user": "é" * 65}, 400, "user", None),
    ("user-control", "POST", COMPL, {"model": M, "prompt": "x", "user": "a\nb"}, 400, "user", None),
    ("stream-bad-prompt", "POST", COMPL, {"model": M, "prompt": "", "stream": True}, 400, "prompt", None),
    ("unknown-model", "POST", COMPL, {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("chat-no-messages", "POST", CHAT, {"model": M}, 400, "messages", None),
    ("chat-empty", "POST", CHAT, {"model": M, "messages": []}, 400, "messages", None),
    ("chat-role", "POST", CHAT, {"model": M, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("chat-content", "POST", CHAT, {"model": M, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("chat-temperature", "POST", CHAT, {"model": M, "messages": OK_CHAT, "temperature": 1000}, 400, "temperature", None),
    ("chat-stream-n", "POST", CHAT, {"model": M, "messages": OK_CHAT, "stream": True, "n": 99}, 400, "n", None),
    ("lookup-nothing", "POST", "/v1/cache/lookup", {}, 400, "prompt", None),
    ("lookup-bad-id", "POST", "/v1/cache/lookup", {"prompt": [10**9]}, 400, "prompt", None),
    ("flush-tier", "POST", "/v1/cache/flush", {"tier": "gpu"}, 400, "tier", None),
    ("billing-tenant", "GET", "/v1/cache/billing?tenant=", None, 400, "tenant", None),
    ("unknown-route", "GET", "/v1/nothing", None, 404, None, "unknown_url"),
    # Issue 7, item 8: input that used to be a 500.
    ("lone-surrogate", "POST", COMPL, b'{"model": "m", "prompt": "a\\ud800b"}', 400, "prompt", None),
    ("lone-surrogate-chat", "POST", CHAT,
     b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages[0].content", None),
    ("lone-surrogate-lookup", "POST", "/v1/cache/lookup", b'{"prompt": "\\ud800"}', 400, "prompt", None),
    ("nested-100k", "POST", COMPL, b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     "invalid_json"),
    # Issue 7, item 9: fields a user would believe were honoured are refused, naming the field.
    ("tools", "POST", CHAT, {"model": M, "messages": OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", None),
    ("tool-choice", "POST", CHAT, {"model": M, "messages": OK_CHAT, "tool_choice": "required"}, 400, "tool_choice", None),
    ("parallel-tool-calls", "POST", CHAT, {"model": M, "messages": OK_CHAT, "parallel_tool_calls": True}, 400,
     "parallel_tool_calls", None),
    ("json-mode", "POST", CHAT, {"model": M, "messages": OK_CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", None),
    ("json-schema", "POST", CHAT, {"model": M, "messages": OK_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400, "response_format", None),
    ("modalities", "POST", CHAT, {"model": M, "messages": OK_CHAT, "modalities": ["text", "audio"]}, 400, "modalities",
     None),
    ("audio", "POST", CHAT, {"model": M, "messages": OK_CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400,
     "audio", None),
    ("prediction", "POST", CHAT, {"model": M, "messages": OK_CHAT, "prediction": {"type": "content", "content": "x"}},
     400, "prediction", None),
    ("message-name", "POST", CHAT, {"model": M, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "messages[0].name", None),
    ("chat-top-logprobs-alone", "POST", CHAT, {"model": M, "messages": OK_CHAT, "top_logprobs": 0}, 400, "top_logprobs",
     None),
    ("chat-top-logprobs-21", "POST", CHAT, {"model": M, "messages": OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("stream-options-no-stream", "POST", COMPL, {"model": M, "prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("max-tokens-past-context", "POST", COMPL, {"model": M, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", None),
    ("chat-max-tokens-past-context", "POST", CHAT, {"model": M, "messages": OK_CHAT, "max_completion_tokens": 10**6}, 400,
     "max_tokens", None),
    ("seed-huge", "POST", COMPL, {"model": M, "prompt": "x", "seed": 2**70}, 400, "seed", None),
    ("wrong-method", "GET", COMPL, None, 405, None, "method_not_allowed"),
    # Issue 17, item 4: the sampling fields now honoured are validated, naming the field.
    ("repetition-penalty-0", "POST", COMPL, {"model": M, "prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty", None),
    ("frequency-penalty-3", "POST", COMPL, {"model": M, "prompt": "x", "frequency_penalty": 3}, 400,
     "frequency_penalty", None),
    ("presence-penalty-str", "POST", CHAT, {"model": M, "messages": OK_CHAT, "presence_penalty": "1"}, 400,
     "presence_penalty", None),
    ("chat-presence-penalty-neg", "POST", CHAT, {"model": M, "messages": OK_CHAT, "presence_penalty": -2.5}, 400,
     "presence_penalty", None),
    ("min-p-2", "POST", COMPL, {"model": M, "prompt": "x", "min_p": 2}, 400, "min_p", None),
    ("min-tokens-past-max", "POST", COMPL, {"model": M, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens", None),
    ("chat-min-tokens-neg", "POST", CHAT, {"model": M, "messages": OK_CHAT, "min_tokens": -1}, 400, "min_tokens", None),
    ("stop-token-ids-neg", "POST", COMPL, {"model": M, "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids",
     None),
    ("stop-token-ids-str", "POST", CHAT, {"model": M, "messages": OK_CHAT, "stop_token_ids": "2"}, 400,
     "stop_token_ids", None),
    ("stop-token-ids-past-vocab", "POST", COMPL, {"model": M, "prompt": "x", "stop_token_ids": [10**9]}, 400,
     "stop_token_ids", None),
    ("include-stop-str-int", "POST", COMPL, {"model": M, "prompt": "x", "include_stop_str_in_output": 1}, 400,
     "include_stop_str_in_output", None),
    ("max-completion-tokens-differs", "POST", COMPL, {"model": M, "prompt": "x", "max_tokens": 3,
                                                      "max_completion_tokens": 4}, 400, "max_completion_tokens", None),
    ("chat-max-completion-tokens-differs", "POST", CHAT, {"model": M, "messages": OK_CHAT, "max_tokens": 3,
                                                          "max_completion_tokens": 4}, 400, "max_completion_tokens",
     None),
    ("completions-max-completion-tokens-0", "POST", COMPL, {"model": M, "prompt": "x", "max_completion_tokens": 0},
     400, "max_tokens", None),
]


def substitute(body, model):
    if isinstance(body, dict):
        return {k: (model if v == M else v) for k, v in body.items()}
    return body


def send(body) -> dict:
    """httpx keyword arguments for a case's body: raw bytes are sent as JSON too."""
    if isinstance(body, bytes):
        return {"content": body, "headers": {"content-type": "application/json"}}
    return {"json": body} if body is not None else {}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(client, engine, case):
    _, method, path, body, status, param, code = case
    r = client.request(method, path, **send(substitute(body, engine.model_name)))
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}[status]
    assert err["param"] == param and err["code"] == code
    if param:
        assert err["message"].startswith(param.split("[")[0])     # the message names the field


def test_server_keeps_serving_after_errors(client, engine):
    for case in CASES:
        client.request(case[1], case[2], **send(substitute(case[3], engine.model_name)))
    r = client.post(COMPL, json={"model": engine.model_name, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200
    assert client.get("/health").json()["in_flight"] == 0


def long_request(url, model, results, key, **extra):
    with httpx.Client(base_url=url, timeout=120) as c:
        results[key] = c.post(COMPL, json={"model": model, "prompt": "go", "max_tokens": LONG, "ignore_eos": True,
                                           "temperature": 0, **extra})


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_service_queue_full_is_429(engine):
    with ServerThread(engine, ServiceSettings(max_queue=1, close_engine_on_shutdown=False)) as s, s.client() as c:
        results = {}
        t = threading.Thread(target=long_request, args=(s.url, engine.model_name, results, "long"))
        t.start()
        wait_for(lambda: c.get("/health").json()["in_flight"] == 1)
        r = c.post(COMPL, json={"model": engine.model_name, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"] == {
            "message": "the server is busy: 1 requests in flight", "type": "rate_limit_error", "param": None,
            "code": "queue_full"}
        t.join(timeout=120)
        assert results["long"].status_code == 200
        assert c.post(COMPL, json={"model": engine.model_name, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_engine_queue_full_is_429(tmp_path, tokenizer):
    eng = build_engine(tmp_path, tokenizer, max_queue=0)       # the engine admits nothing
    with ServerThread(eng) as s, s.client() as c:
        for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
            r = c.post(COMPL, json={"model": eng.model_name, "max_tokens": 1, **body})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_closed_engine_is_503(tmp_path, tokenizer):
    eng = build_engine(tmp_path, tokenizer)
    eng.close()
    with ServerThread(eng) as s, s.client() as c:
        r = c.post(COMPL, json={"model": eng.model_name, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_closed"
        r = c.post(CHAT, json={"model": eng.model_name, "messages": OK_CHAT, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_draining_server_is_503(engine):
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s, s.client() as c:
        s.app.state.tieredkv.dispatcher.start_draining()
        r = c.post(COMPL, json={"model": engine.model_name, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert c.get("/health").status_code == 503


def test_timeout_is_504_and_aborts_the_request(engine):
    with ServerThread(engine, ServiceSettings(request_timeout_s=0.05, close_engine_on_shutdown=False)) as s, \
            s.client() as c:
        results = {}
        long_request(s.url, engine.model_name, results, "r", user="t-timeout")
        r = results["r"]
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert "aborted" in r.json()["error"]["message"]
        # The engine stopped the request and billed it for what reached the client: its prompt
        # (once admitted), no completion tokens. (It used to run all 300 tokens and bill them.)
        wait_for(lambda: c.get("/v1/cache/billing", params={"tenant": "t-timeout"}).json()["requests"] == 1)
        bill = c.get("/v1/cache/billing", params={"tenant": "t-timeout"}).json()
        assert bill["completion_tokens"] == 0 and bill["prompt_tokens"] in (0, 1)
        assert engine.cache_status()["engine"]["aborted"].get("timeout", 0) >= 1
        wait_for(lambda: c.get("/health").json()["in_flight"] == 0)


def test_a_body_past_the_limit_is_413_without_being_buffered(engine):
    settings = ServiceSettings(max_body_bytes=64 << 10, close_engine_on_shutdown=False)
    with ServerThread(engine, settings) as s, s.client() as c:
        big = b'{"model": "m", "prompt": "' + b"x" * (1 << 20) + b'"}'
        for kw in ({"content": big}, {"content": iter([big[i:i + 4096] for i in range(0, len(big), 4096)])}):
            r = c.post(COMPL, headers={"content-type": "application/json"}, **kw)   # sized, then chunked
            assert r.status_code == 413, r.text
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "request_too_large"
        assert c.post(COMPL, json={"model": engine.model_name, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_an_unhandled_error_is_a_500_and_the_connection_stays_open(engine):
    # A route that fails with a bug, added to the real app (the server has no such route): the
    # catch-all must answer with OpenAI's body and keep the keep-alive connection usable.
    with ServerThread(engine, ServiceSettings(close_engine_on_shutdown=False)) as s:
        @s.app.get("/test-only/bug")
        async def bug() -> None:
            raise KeyError("a bug")
        with s.client() as c:
            r = c.get("/test-only/bug")
            assert r.status_code == 500 and r.json()["error"] == {
                "message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}
            assert r.headers.get("connection", "").lower() != "close"
            r2 = c.post(COMPL, json={"model": engine.model_name, "prompt": "x", "max_tokens": 1})
            assert r2.status_code == 200
            assert r.extensions["network_stream"] is r2.extensions["network_stream"]   # the same connection


def test_the_openapi_document_describes_the_request_bodies(client):
    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"model", "prompt", "max_tokens", "stream"} <= set(props)
    assert "ChatMessage" in doc["components"]["schemas"]
    # Issue 17: the sampling fields now honoured are documented, and unknown fields are refused.
    for name in ("CompletionRequest", "ChatRequest"):
        schema = doc["components"]["schemas"][name]
        assert {"stop_token_ids", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p",
                "max_completion_tokens", "include_stop_str_in_output"} <= set(schema["properties"])
        assert schema["additionalProperties"] is False
