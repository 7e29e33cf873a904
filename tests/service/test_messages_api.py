"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real server on loopback,
driven by the official `anthropic` client: shapes, greedy text equal to chat's, cache_control
usage, streaming, refusals, errors in Anthropic's shape, x-api-key tenants, client disconnects."""
from __future__ import annotations

import json
import logging
import re
import time

import anthropic
import httpx
import openai
import pytest

from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, write_keys
from tests.service.tiny_engine import BLOCK_SIZE, build_engine

SYSTEM = "You are a careful assistant who answers in one short sentence about the weather in spring."
DOC_A = "The first document says that April in the north is wet, with cold winds from the sea."
DOC_B = " The second document says that May is warmer, and the rain comes in short heavy showers."
QUESTION = "Which month is warmer, according to the documents?"
REPLY = "May is warmer."
FOLLOW_UP = "And which one is wetter overall? Answer briefly."


def greedy(**kw):
    return {"extra_body": {"temperature": 0, **kw}}       # anthropic 2.x sends no temperature of its own


@pytest.fixture
def anth(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def marked(text: str, ttl: str | None = None) -> dict:
    cc = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    return {"type": "text", "text": text, "cache_control": cc}


def four_breakpoints() -> dict:
    """A conversation with 4 cache_control breakpoints: the system prompt (1h), two document
    blocks and the assistant's reply (5m); the last user turn after them is unmarked."""
    return {"system": [marked(SYSTEM, "1h")],
            "messages": [{"role": "user", "content": [marked(DOC_A), marked(DOC_B),
                                                      {"type": "text", "text": " " + QUESTION}]},
                         {"role": "assistant", "content": [marked(REPLY)]},
                         {"role": "user", "content": FOLLOW_UP}]}


def templated(tokenizer, messages: list[dict]) -> list[int]:
    """The model's own chat template over `messages`, with no generation prompt."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def created(u) -> dict:
    """`usage.cache_creation` as a dict (a typed field in newer clients, an extra one in older)."""
    return u.model_dump()["cache_creation"]


def check_usage(u, prompt_tokens: int) -> None:
    """Anthropic's usage adds up to the prompt; the by-tier read sums to the read."""
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt_tokens
    assert created(u)["ephemeral_5m_input_tokens"] + created(u)["ephemeral_1h_input_tokens"] == \
        u.cache_creation_input_tokens
    assert sum(u.model_extra["cache_read_input_tokens_by_tier"].values()) == u.cache_read_input_tokens


def test_a_message_equals_the_chat_completion_of_the_same_conversation(anth, server, engine):
    messages = [{"role": "user", "content": QUESTION}]
    m = anth.messages.create(model=engine.model_name, max_tokens=6, system=SYSTEM, messages=messages,
                             metadata={"user_id": "t-msg-shape"}, **greedy())
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == engine.model_name
    assert [b.type for b in m.content] == ["text"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as oai:
        chat = oai.chat.completions.create(model=engine.model_name, max_tokens=6, temperature=0, user="t-msg-chat",
                                           messages=[{"role": "system", "content": SYSTEM}, *messages])
    assert m.content[0].text == chat.choices[0].message.content
    assert (m.stop_reason, chat.choices[0].finish_reason) in (("max_tokens", "length"), ("end_turn", "stop"))
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens == chat.usage.prompt_tokens        # no breakpoint, nothing cached: all input
    assert (m.usage.cache_creation_input_tokens, m.usage.cache_read_input_tokens) == (0, 0)
    check_usage(m.usage, chat.usage.prompt_tokens)
    count = anth.messages.count_tokens(model=engine.model_name, system=SYSTEM, messages=messages)
    assert count.input_tokens == chat.usage.prompt_tokens


def test_cache_control_usage_first_creates_then_reads(anth, engine, tokenizer):
    convo = four_breakpoints()
    prompt = anth.messages.count_tokens(model=engine.model_name, **convo).input_tokens
    first = anth.messages.create(model=engine.model_name, max_tokens=3, metadata={"user_id": "t-msg-cache"},
                                 **convo, **greedy()).usage
    check_usage(first, prompt)
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0 and first.input_tokens > 0
    # The 1h breakpoint ends the system message: its segment is that message, closing tokens and all.
    system_only = templated(tokenizer, [{"role": "system", "content": SYSTEM}])
    assert created(first)["ephemeral_1h_input_tokens"] == len(system_only)
    # The 5m ones run to the end of the assistant's reply: the last user turn is input.
    through_reply = templated(tokenizer, [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": DOC_A + DOC_B + " " + QUESTION},
                                          {"role": "assistant", "content": REPLY}])
    assert first.cache_creation_input_tokens == len(through_reply)
    assert first.input_tokens == prompt - len(through_reply)

    again = anth.messages.create(model=engine.model_name, max_tokens=3, metadata={"user_id": "t-msg-cache"},
                                 **convo, **greedy()).usage
    check_usage(again, prompt)
    read = again.cache_read_input_tokens
    assert read >= (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > len(through_reply)   # the prefix's full blocks hit
    assert again.model_extra["cache_read_input_tokens_by_tier"]["device"] == read
    assert again.cache_creation_input_tokens == 0 and again.input_tokens == prompt - read
    # Another tenant shares nothing of it.
    other = anth.messages.create(model=engine.model_name, max_tokens=3, metadata={"user_id": "t-msg-cache-2"},
                                 **convo, **greedy()).usage
    assert other.cache_read_input_tokens == 0 and other.cache_creation_input_tokens == len(through_reply)


def test_a_top_level_cache_control_marks_the_last_block(anth, engine, tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    u = anth.messages.create(model=engine.model_name, max_tokens=2, messages=messages, **greedy(
        cache_control={"type": "ephemeral", "ttl": "1h"}, metadata={"user_id": "t-msg-top"})).usage
    prompt = anth.messages.count_tokens(model=engine.model_name, messages=messages).input_tokens
    check_usage(u, prompt)
    # Everything through the last message is created under its ttl; the assistant's opening is input.
    assert created(u)["ephemeral_1h_input_tokens"] == len(templated(tokenizer, messages)) == prompt - u.input_tokens
    assert 0 < u.input_tokens < prompt


def test_five_breakpoints_is_a_400(anth, engine):
    convo = four_breakpoints()
    convo["messages"][-1]["content"] = [marked(FOLLOW_UP)]
    with pytest.raises(anthropic.BadRequestError) as e:
        anth.messages.create(model=engine.model_name, max_tokens=3, **convo)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "a maximum of 4 blocks with cache_control" in e.value.body["error"]["message"]
    # The top-level cache_control is a breakpoint too (on the last block): 4 marked blocks + it = 5.
    with pytest.raises(anthropic.BadRequestError):
        anth.messages.create(model=engine.model_name, max_tokens=3, extra_body={"cache_control": {"type": "ephemeral"}},
                             **four_breakpoints())


@pytest.mark.parametrize("kw,words", [
    ({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}, "tools: tool use is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "type 'image': not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: extended thinking is not supported"),
    ({"extra_body": {"frobnicate": True}}, "Unrecognized request argument supplied: frobnicate"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]},
     "(prefill) is not supported"),
    ({"stop_sequences": [""]}, "stop_sequences: expected non-empty strings"),
])
def test_unsupported_fields_are_refused(anth, engine, kw, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        anth.messages.create(model=engine.model_name, max_tokens=3, **body)
    assert e.value.body["error"]["type"] == "invalid_request_error" and words in e.value.body["error"]["message"]


def test_a_stream_has_anthropics_events_and_the_same_text_and_usage(anth, engine):
    convo = four_breakpoints()
    kw = dict(model=engine.model_name, max_tokens=8, metadata={"user_id": "t-msg-stream"}, **convo, **greedy())
    anth.messages.create(**kw)                          # the prefix cached
    whole = anth.messages.create(**kw)                  # a warm request, as the stream's will be
    with anth.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.id.startswith("msg_")
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.model_dump() == whole.usage.model_dump()
    # message_start already says what the prompt cost (from the first chunk's hits).
    start = events[0].message.usage
    assert (start.input_tokens, start.cache_read_input_tokens, start.cache_creation_input_tokens) == \
        (whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.cache_creation_input_tokens)


def test_a_stop_sequence_ends_the_text_and_is_named(anth, engine):
    kw = dict(model=engine.model_name, max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
              metadata={"user_id": "t-msg-stop"}, **greedy())
    text = anth.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"the greedy text has no usable stop sequence: {text!r}"
    m = anth.messages.create(stop_sequences=[stop], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[:text.index(stop)]
    with anth.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, m.content[0].text)


def test_errors_are_anthropic_shaped(anth, engine):
    with pytest.raises(anthropic.NotFoundError) as e:
        anth.messages.create(model="no-such-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "no-such-model" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:         # max_tokens past the context: never clamped
        anth.messages.create(model=engine.model_name, max_tokens=engine.max_context,
                             messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["message"].startswith("max_tokens: the context is")
    settings = ServiceSettings(max_body_bytes=64 << 10, close_engine_on_shutdown=False)
    with ServerThread(engine, settings) as s, s.client() as c:
        r = c.post("/v1/messages", json={"model": engine.model_name, "max_tokens": 1,
                                         "messages": [{"role": "user", "content": "x" * (1 << 20)}]})
        assert r.status_code == 413 and r.json() == {"type": "error", "error": {
            "type": "request_too_large", "message": "request body: larger than the server's limit of 65536 bytes"}}
        r = c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        assert c.post("/v1/messages", content=b"{").json()["error"]["type"] == "invalid_request_error"   # 415

        @s.app.post("/v1/messages/test-only-bug")
        async def bug() -> None:
            raise KeyError("a bug")
        r = c.post("/v1/messages/test-only-bug")
        assert r.status_code == 500 and r.json() == {"type": "error", "error": {
            "type": "api_error", "message": "internal server error"}}
        s.app.state.tieredkv.dispatcher.start_draining()
        r = c.post("/v1/messages", json={"model": engine.model_name, "max_tokens": 1,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        # The OpenAI routes keep OpenAI's shape.
        r = c.post("/v1/chat/completions", json={"model": engine.model_name, "messages": []})
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


ACME, BETA = "sk-acme-msg-0001", "sk-beta-msg-0001"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("msg-keys")
    keys = {ACME: {"tenant": "acme"}, BETA: {"tenant": "beta"}, "sk-ops-msg-0001": {"tenant": "ops", "role": "admin"}}
    settings = ServiceSettings(api_keys_file=write_keys(tmp / "keys.json", keys))
    with ServerThread(build_engine(tmp, tokenizer), settings) as s:
        yield s


def test_x_api_key_names_the_tenant_that_is_billed(keyed):
    model = keyed.engine.model_name
    body = dict(model=model, max_tokens=2, messages=[{"role": "user", "content": QUESTION}], **greedy())
    with anthropic.Anthropic(base_url=keyed.url, api_key=ACME, max_retries=0) as c:
        m = c.messages.create(metadata={"user_id": "beta"}, **body)        # the key names the tenant, not user_id
        n = c.messages.count_tokens(model=model, messages=body["messages"]).input_tokens
    with anthropic.Anthropic(base_url=keyed.url, auth_token=BETA, max_retries=0) as c:   # Authorization: Bearer
        c.messages.create(**body)
    with keyed.client(headers={"Authorization": "Bearer sk-ops-msg-0001"}) as admin:
        acme = admin.get("/v1/cache/billing", params={"tenant": "acme"}).json()
        beta = admin.get("/v1/cache/billing", params={"tenant": "beta"}).json()
    assert acme["requests"] == 1 and acme["prompt_tokens"] == n == m.usage.input_tokens
    assert acme["completion_tokens"] == m.usage.output_tokens
    assert beta["requests"] == 1
    with anthropic.Anthropic(base_url=keyed.url, api_key="sk-nobody-0000", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(**body)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    with keyed.client(headers={"x-api-key": ACME, "Authorization": f"Bearer {BETA}"}) as c:
        r = c.post("/v1/messages/count_tokens", json={"model": model, "messages": body["messages"]})
        assert r.status_code == 401 and "different keys" in r.json()["error"]["message"]
    with keyed.client(headers={"x-api-key": ACME}) as c:      # the OpenAI routes take Authorization only
        assert c.post("/v1/chat/completions", json={"model": model, "messages": body["messages"]}).status_code == 401


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_stream_closed_early_is_aborted_and_billed_for_what_was_sent(engine, caplog):
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    body = {"model": engine.model_name, "max_tokens": 900, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "go on"}], "metadata": {"user_id": "t-msg-gone"}}
    with ServerThread(engine, ServiceSettings(max_queue=1, close_engine_on_shutdown=False)) as s, s.client() as c:
        with httpx.Client(base_url=s.url, timeout=60) as gone, gone.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200 and r.headers["request-id"].startswith("msg_")
            lines = r.iter_lines()
            assert next(lines) == "event: message_start"
            # While it streams, the one slot is taken: another request is a 429 in Anthropic's shape.
            busy = c.post("/v1/messages", json={**body, "stream": False, "max_tokens": 1})
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
            assert busy.headers["retry-after"]
            assert any(line.startswith("event: content_block_delta") for line in lines)   # then it hangs up
        bill = lambda: c.get("/v1/cache/billing", params={"tenant": "t-msg-gone"}).json()    # noqa: E731
        wait_for(lambda: bill()["requests"] == 1)
        found = []
        wait_for(lambda: found.extend(x for x in caplog.records if x.name == "tieredkv.requests"
                                      and x.request_fields.get("tenant") == "t-msg-gone"
                                      and x.request_fields["status"] == 200) or found)
        sent = int(re.search(r"disconnected after (\d+) output tokens", found[0].request_fields["reason"]).group(1))
        assert bill()["completion_tokens"] == sent and 1 <= sent < 900
        assert found[0].request_fields["id"] == r.headers["request-id"]


def test_the_openapi_document_has_the_messages_bodies(server):
    with server.client() as c:
        doc = c.get("/openapi.json").json()
    op = doc["paths"]["/v1/messages"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    assert "max_tokens" in doc["components"]["schemas"]["MessagesRequest"]["required"]
    json.dumps(doc)
