"""Issue 7, item 10: a bounded schemathesis run against the real tiny-model server on loopback.

Schemathesis reads the server's own /openapi.json and generates request bodies from it (valid
ones and the odd ones its strategies produce: unicode edge cases, huge numbers, empty and
nested values). Every answer must be below 500, and every error OpenAI-shaped (Anthropic-shaped on
the Messages routes).
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

EXAMPLES = 25          # per operation: bounded, a few seconds each on the tiny model


def operations(client, model: str) -> list:
    doc = client.get("/openapi.json").json()
    # Name the served model, so generated requests reach generation instead of stopping at 404.
    for name in ("CompletionRequest", "ChatRequest", "MessagesRequest", "CountTokensRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"const": model}
    schema = schemathesis.openapi.from_dict(doc)
    return [r.ok() for r in schema.get_all_operations()]


def test_no_generated_request_gets_a_5xx_and_every_error_is_shaped(client, engine) -> None:
    ops = operations(client, engine.model_name)
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/cache/lookup"),
        ("POST", "/v1/cache/flush"), ("GET", "/v1/cache/status"), ("GET", "/v1/models"), ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens")}
    seen: dict[str, set[int]] = {}
    for op in ops:
        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case) -> None:
            kw = {"params": case.query} if case.query else {}
            if case.body is not None and not isinstance(case.body, schemathesis.core.NotSet):
                kw["json"] = case.body
            r = client.request(case.method, case.formatted_path, **kw)
            seen.setdefault(op.label, set()).add(r.status_code)
            assert r.status_code < 500, (case.method, case.formatted_path, case.body, r.text)
            if r.status_code >= 400 and op.path.startswith("/v1/messages"):
                assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}, r.text
                assert r.json()["error"]["message"], r.text
            elif r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        check()
    assert len(seen) == len(ops)
    assert 200 in seen["POST /v1/completions"] | seen["POST /v1/chat/completions"]   # generation was reached
