"""Issue 39, item 3 -- OpenAI's prompt caching fields on a server: `prompt_cache_key` is accepted
on both generation routes and written in the request log line; `prompt_cache_retention`
"in_memory" and "24h" (the whole prompt kept a day, billed as a cache write) are accepted,
anything else is a 400 naming the field, never silently ignored. The official `openai` client
sends them in extra_body. (What "24h" keeps through floods and restarts:
tests/service/test_retention_service.py.)"""
from __future__ import annotations

import logging

import openai
import pytest

from tests.service.router.harness import wait_for
from tests.service.tiny_engine import BLOCK_SIZE

CHAT = [{"role": "user", "content": "hi"}]


def log_lines(caplog, tenant: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tieredkv.requests" and r.request_fields.get("tenant") == tenant]


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_prompt_cache_key_is_accepted_and_logged_on_both_routes(oai, engine, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.requests")
    r = oai.completions.create(model=engine.model_name, prompt="cache me", max_tokens=2, user="t-pck-a",
                               extra_body={"prompt_cache_key": "conv-42", "prompt_cache_retention": "in_memory"})
    assert r.usage.completion_tokens == 2
    c = oai.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=2, user="t-pck-b",
                                    extra_body={"prompt_cache_key": 'odd "key"\n'})
    assert c.usage.completion_tokens == 2
    oai.completions.create(model=engine.model_name, prompt="no key", max_tokens=1, user="t-pck-c")

    wait_for(lambda: log_lines(caplog, "t-pck-a") and log_lines(caplog, "t-pck-b") and log_lines(caplog, "t-pck-c"))
    a, b, none = (log_lines(caplog, t)[0] for t in ("t-pck-a", "t-pck-b", "t-pck-c"))
    assert a.request_fields["cache_key"] == "conv-42" and "cache_key=conv-42" in a.getMessage()
    assert 'cache_key=odd \\"key\\"\\n' in b.getMessage(), b.getMessage()     # escaped: one line
    assert "cache_key" not in none.request_fields and "cache_key=" not in none.getMessage()


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("extra,param,words", [
    ({"prompt_cache_key": "k" * 257}, "prompt_cache_key", "1 to 256 characters"),
    ({"prompt_cache_key": ""}, "prompt_cache_key", "1 to 256 characters"),
    ({"prompt_cache_key": 7}, "prompt_cache_key", ""),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", '"in_memory" or "24h"'),
    ({"prompt_cache_retention": "24H"}, "prompt_cache_retention", '"in_memory" or "24h"'),
], ids=["too-long", "empty", "not-a-string", "other", "wrong-case"])
def test_bad_cache_fields_are_a_400_naming_the_field(oai, engine, route, extra, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            oai.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=1, extra_body=extra)
        else:
            oai.completions.create(model=engine.model_name, prompt="x", max_tokens=1, extra_body=extra)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(f"{param}: ") and words in err["message"], err


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_24h_is_accepted_and_billed_as_a_cache_write(oai, engine, route) -> None:
    kw = dict(model=engine.model_name, max_tokens=1, user=f"t-pcr-24h-{route}",
              extra_body={"prompt_cache_retention": "24h"})

    def send():
        if route == "chat":
            return oai.chat.completions.create(messages=[{"role": "user", "content": "keep this one for a day"}], **kw)
        return oai.completions.create(prompt="keep this one for a day, please, it is worth it", **kw)
    r = send()
    u = r.usage.model_dump()
    assert u["cache_write_tokens"] == {"24h": r.usage.prompt_tokens} and u["retention_refused_tokens"] == 0
    assert u["retained_token_seconds"] == r.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE * 86400
    again = send()
    read = again.usage.prompt_tokens_details.cached_tokens
    assert read > 0                                              # read, not written again
    assert again.usage.model_dump().get("cache_write_tokens", {}).get("24h", 0) == again.usage.prompt_tokens - read


def test_a_key_of_256_characters_is_accepted(oai, engine) -> None:
    r = oai.completions.create(model=engine.model_name, prompt="x", max_tokens=1,
                               extra_body={"prompt_cache_key": "k" * 256})
    assert r.usage.completion_tokens == 1
