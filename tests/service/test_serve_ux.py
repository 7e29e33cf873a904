"""Issue 20, item 3: what a `vllm serve` / `llama-server` user expects of the server -- /tokenize,
/detokenize, /version, /docs, a served model name, a max model len, one log line per request,
the startup summary and the flushed-block count at shutdown. A real server on loopback over the
tiny random-weight model with the real tokenizer (tests/service/conftest.py)."""
from __future__ import annotations

import logging
import re
import socket
import time
from pathlib import Path

import pytest

import tieredkv
from engine.engine import context_length
from service.settings import ServiceSettings
from service.summary import format_summary, startup_summary
from storage.config import parse_size
from storage.disk.tier import DiskTier
from tests.service.conftest import ServerThread, sse_events, write_keys
from tests.service.tiny_engine import BLOCK_SIZE, build_engine

COMPL = "/v1/completions"
PROMPT = "The tiered cache keeps every block it computed, " * 4


def request_lines(caplog, n: int) -> list[logging.LogRecord]:
    """The first n records of tieredkv.requests. The line is written once the response is sent,
    so it may land a moment after the client has the answer: wait for it (bounded)."""
    deadline = time.monotonic() + 30
    while True:
        found = [r for r in caplog.records if r.name == "tieredkv.requests"]
        if len(found) >= n or time.monotonic() > deadline:
            return found[:n]
        time.sleep(0.01)


# ---- /tokenize, /detokenize, /version, /docs -------------------------------------------------

def test_tokenize_counts_what_a_completion_is_billed_and_detokenize_gives_the_text_back(client, engine) -> None:
    r = client.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.max_context
    usage = client.post(COMPL, json={"model": engine.model_name, "prompt": PROMPT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}
    # The model may be named; a chat's messages are counted through the chat template.
    named = client.post("/tokenize", json={"model": engine.model_name, "prompt": PROMPT}).json()
    assert named["tokens"] == body["tokens"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == engine.apply_chat_template([{"role": "user", "content": "hi"}])
    # A prompt longer than the context is still counted: that is what the client wants to know.
    long = client.post("/tokenize", json={"prompt": "word " * (engine.max_context + 10)}).json()
    assert long["count"] > long["max_model_len"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/tokenize", {}, 400, "give exactly one"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "give exactly one"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"model": "other-model", "prompt": "a"}, 404, "other-model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"model": "other-model", "tokens": [1]}, 404, "other-model"),
])
def test_tokenizer_routes_refuse_bad_input_with_an_openai_error(client, path: str, body: dict, status: int,
                                                                 words: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert client.post(path, content=b"not json", headers={"content-type": "application/json"}).status_code == 400


def test_version_and_docs_work_offline(client) -> None:
    assert client.get("/version").json() == {"version": tieredkv.__version__}
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'href="/openapi.json"' in page
    for route in ("POST /v1/completions", "POST /tokenize", "POST /detokenize", "GET /version", "GET /v1/models"):
        assert route in page, route
    # Nothing to fetch: no script, no stylesheet or link to another host.
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "TokenizeRequest" in page         # request bodies are drawn from the real schemas
    doc = client.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/version"} <= set(doc["paths"]) and "/docs" not in doc["paths"]


def test_tokenizer_routes_need_a_key_where_v1_routes_do(tmp_path: Path, tokenizer) -> None:
    keys = write_keys(tmp_path / "keys.json", {"sk-user-0001": {"tenant": "acme", "role": "user"}})
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(api_keys_file=keys)) as s, s.client() as c:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert c.post(path, json=body, headers={"Authorization": "Bearer sk-user-0001"}).status_code == 200
        assert c.get("/v1/models").status_code == 401
        # Like /health and /openapi.json: no key needed.
        assert c.get("/version").status_code == 200 and c.get("/docs").status_code == 200


# ---- --served-model-name and --max-model-len ---------------------------------------------------

def test_a_served_model_name_is_listed_echoed_and_accepted_beside_the_real_name(tmp_path: Path, tokenizer) -> None:
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(served_model_name="my-model")) as s, s.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["my-model"]
        assert c.get("/v1/models/my-model").json()["id"] == "my-model"
        for name in ("my-model", eng.model_name):
            r = c.post(COMPL, json={"model": name, "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
            r = c.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
        with c.stream("POST", COMPL, json={"model": "my-model", "prompt": PROMPT, "max_tokens": 2,
                                           "stream": True}) as r:
            events = sse_events(r)
        assert {e["model"] for e in events if isinstance(e, dict)} == {"my-model"}
        r = c.post(COMPL, json={"model": "gpt-4", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and "'my-model'" in r.json()["error"]["message"], r.text
    with pytest.raises(ValueError, match="served_model_name"):
        ServiceSettings(served_model_name=" ")


def test_context_length_is_the_smallest_limit_and_says_which() -> None:
    assert context_length(1024, 256, 8) == (1024, "model")              # the pool holds 2,048
    assert context_length(1024, 16, 8) == (128, "device_pool")
    assert context_length(1024, 256, 8, max_model_len=512) == (512, "max_model_len")
    assert context_length(1024, 256, 8, max_model_len=1024) == (1024, "max_model_len")
    with pytest.raises(ValueError, match=r"^max_model_len: 2,048 tokens do not fit the device pool, which holds 128"):
        context_length(4096, 16, 8, max_model_len=2048)
    with pytest.raises(ValueError, match=r"^max_model_len: 2,048 tokens is more than the model's context of 1,024"):
        context_length(1024, 1024, 8, max_model_len=2048)
    for bad in (0, 1, True, 2.5, "64"):
        with pytest.raises(ValueError, match="max_model_len: expected an int >= 2"):
            context_length(1024, 256, 8, max_model_len=bad)


def test_max_model_len_bounds_requests_and_is_what_the_api_reports(tmp_path: Path, tokenizer) -> None:
    from tieredkv import Engine
    from tests.service.tiny_engine import tiny_config
    from engine.model import model_from_config
    from storage.config import CacheConfig
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory="1MiB", host_memory="512KiB",
                        disk_dir=str(tmp_path / "kv"), disk_capacity="64MiB")
    with pytest.raises(ValueError, match="max_model_len: 4,096 tokens is more than"):
        Engine.from_loaded(loaded, cache, max_model_len=4096)
    assert not (tmp_path / "kv").exists()       # refused before the cache opened anything
    eng = Engine.from_loaded(loaded, cache, max_model_len=64)
    assert (eng.max_context, eng.max_context_source) == (64, "max_model_len")
    with ServerThread(eng) as s, s.client() as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 64
        r = c.post(COMPL, json={"model": eng.model_name, "prompt": "word " * 70, "max_tokens": 1})
        assert r.status_code == 400 and "64" in r.json()["error"]["message"], r.text
        r = c.post(COMPL, json={"model": eng.model_name, "prompt": "word " * 20, "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# ---- the per-request log line --------------------------------------------------------------------

def test_one_log_line_per_request_with_tokens_hits_ttft_and_the_reason_of_an_error(tmp_path: Path, tokenizer,
                                                                                    caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng) as s, s.client() as c:
        body = {"model": eng.model_name, "prompt": PROMPT, "max_tokens": 3, "user": "alice"}
        first = c.post(COMPL, json=body)
        second = c.post(COMPL, json=body)                       # hits the first one's blocks
        with c.stream("POST", COMPL, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            stream_usage = [e for e in sse_events(r) if isinstance(e, dict) and e.get("usage")][-1]["usage"]
            stream_id = r.headers["x-request-id"]
        bad = c.post(COMPL, json={**body, "max_tokens": -1})
        missing = c.get("/no/such/route%0A", headers={"x-request-id": "client-id-7"})
        c.get("/health")                                        # a probe's success: DEBUG, not INFO
        lines = request_lines(caplog, 5)
    assert [r.levelno for r in lines] == [logging.INFO] * 5

    for record, response in ((lines[0], first), (lines[1], second)):
        f, usage = record.request_fields, response.json()["usage"]
        assert f["id"] == response.headers["x-request-id"] and f["tenant"] == "alice"
        assert (f["method"], f["path"], f["status"]) == ("POST", COMPL, 200)
        assert (f["prompt_tokens"], f["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert f["hit_tokens"] == usage["prompt_cache_hit_tokens_by_tier"]
        assert f["ttft_ms"] >= 0 and "reason" not in f
        msg = record.getMessage()
        assert msg.startswith(f"id={f['id']} tenant=alice POST /v1/completions 200 prompt_tokens={usage['prompt_tokens']} "
                              f"completion_tokens=3 hit_tokens=device:{f['hit_tokens']['device']},host:0,disk:0,remote:0 "
                              "ttft_ms="), msg
    assert lines[1].request_fields["hit_tokens"]["device"] > 0     # the second request's hits are in its line

    f = lines[2].request_fields
    assert f["id"] == stream_id and f["prompt_tokens"] == stream_usage["prompt_tokens"]
    assert f["hit_tokens"] == stream_usage["prompt_cache_hit_tokens_by_tier"] and "ttft_ms" in f

    f = lines[3].request_fields
    assert f["status"] == 400 and f["tenant"] == "alice" and "prompt_tokens" not in f
    assert f["reason"] == bad.json()["error"]["message"] and "max_tokens" in f["reason"]
    assert f'reason="{f["reason"]}"' in lines[3].getMessage()

    f = lines[4].request_fields
    assert (f["status"], f["id"], f["tenant"]) == (404, "client-id-7", "-")
    assert f["reason"] == missing.json()["error"]["message"]
    assert "\n" not in lines[4].getMessage() and "/no/such/route\\n" in lines[4].getMessage()


def test_a_401_is_logged_with_its_reason(tmp_path: Path, tokenizer, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    keys = write_keys(tmp_path / "keys.json", {"sk-user-0001": {"tenant": "acme", "role": "user"}})
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng, ServiceSettings(api_keys_file=keys)) as s, s.client() as c:
        c.post(COMPL, json={"model": eng.model_name, "prompt": "hi"}, headers={"Authorization": "Bearer sk-wrong-key"})
        c.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-user-0001"})
        lines = request_lines(caplog, 2)
    assert (lines[0].request_fields["status"], lines[0].request_fields["reason"]) == (401, "invalid API key")
    assert (lines[1].request_fields["status"], lines[1].request_fields["tenant"]) == (200, "acme")


# ---- startup summary and shutdown ----------------------------------------------------------------

def test_the_startup_summary_names_every_fact_an_operator_checks_first(tmp_path: Path, tokenizer) -> None:
    port = closed_port()
    eng = build_engine(tmp_path, tokenizer, device_memory="64KiB",
                       remote_url=f"valkey://:pw-not-shown@127.0.0.1:{port}", remote_timeout_s=0.2)
    try:
        rows = dict(startup_summary(eng, "http://127.0.0.1:8123", served_model_name="tiny"))
        text = format_summary(list(rows.items()))
    finally:
        eng.close()
    assert rows["model"] == f"{eng.model_name}, served as 'tiny'"
    assert rows["device"] == "cpu, float32, attention gather_sdpa"
    # 64 KiB holds 16 pages of 8 tokens: the pool, not the model (1,024), sets the context.
    assert rows["context"].startswith("128 tokens (max model len), set by the device pool")
    assert "the model allows 1,024" in rows["context"]
    assert rows["device pool"] == "64.0KiB: 16 pages of 8 tokens (4.0KiB each)"
    assert rows["host tier"].startswith("512.0KiB in ")
    assert rows["disk tier"].startswith(f"{tmp_path / 'kv'}, capacity 64.0MiB")
    assert rows["remote tier"] == f"valkey://:***@127.0.0.1:{port} (write_back)"
    assert rows["restores"].startswith("compute or load: auto ") and "stored zstd (zstd level 3)" in rows["restores"]
    assert rows["billing"] == f"{tmp_path / 'billing'}, reserve 16.0MiB"
    assert rows["listen"].startswith("http://127.0.0.1:8123 ")
    assert "pw-not-shown" not in text and all(label in text for label in rows)


def test_shutdown_logs_how_many_blocks_it_flushed(tmp_path: Path, tokenizer, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.service")
    eng = build_engine(tmp_path, tokenizer)
    with ServerThread(eng) as s, s.client() as c:
        r = c.post(COMPL, json={"model": eng.model_name, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200
    closed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine closed")]
    assert len(closed) == 1, closed
    n = int(re.fullmatch(r"engine closed: flushed (\d+) blocks down to the lowest tier", closed[0])[1])
    # Nothing reached the disk before the shutdown (the pool had room): it holds what was flushed.
    tier = DiskTier(str(tmp_path / "kv"), parse_size("64MiB"), readonly=True)
    try:
        assert n == tier.stats().blocks > 0
    finally:
        tier.close()


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
