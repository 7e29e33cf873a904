"""A request's retention through the engine (issue 39): spans retained at submit, and the usage it
is billed -- tokens written under each class (a span's tokens not read), token-seconds bought,
tokens refused -- on a real tiny model over a real disk tier."""
from __future__ import annotations

import pytest

from engine.retain_spans import RetainRecord, RetainSpan, check_spans, retention_usage
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_engine, random_prompt

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def test_written_tokens_follow_each_span_and_stop_where_the_cache_refused() -> None:
    rec = RetainRecord(ends=[(40, "1h"), (100, "5m")], refused_from=None, block_seconds=10.0)
    assert retention_usage(rec, 120, 0, 4) == ({"1h": 40, "5m": 60}, 40, 0)
    assert retention_usage(rec, 120, 48, 4) == ({"5m": 52}, 40, 0)          # read past the first span
    rec.refused_from = 64
    assert retention_usage(rec, 120, 16, 4) == ({"1h": 24, "5m": 24}, 40, 36)
    assert retention_usage(None, 120, 0, 4) == ({}, 0, 0)
    assert retention_usage(rec, 0, 0, 4) == ({}, 40, 0)     # never admitted: nothing written, the retention bought


def test_bad_spans_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="retention class"):
        check_spans([RetainSpan(None, "7d")])
    with pytest.raises(ValueError, match="prompt order"):
        check_spans([RetainSpan(32, "1h"), RetainSpan(16, "5m")])


def test_a_retained_prompt_is_billed_its_write_then_read(tmp_path) -> None:
    eng = make_engine(tmp_path, calibrate=False)
    try:
        ids = random_prompt(41, seed=3)                     # 10 full blocks of 4 (prefix keys: 40 tokens)
        out = eng.generate(ids, GREEDY, tenant="acme", retain=[RetainSpan(None, "24h")])
        u = out.usage
        assert u.prompt_cache_hit_tokens == 0
        assert u.cache_write_tokens == {"24h": 41} and u.retention_refused_tokens == 0
        assert u.retained_token_seconds == 10 * 4 * 86400   # ten blocks bought a day each
        status = eng.cache_status()["retention"]
        assert status["tenants"]["acme"]["blocks"] == 10 and status["keeper"] == "disk"
        again = eng.generate(ids, GREEDY, tenant="acme", retain=[RetainSpan(None, "24h")]).usage
        assert again.prompt_cache_hit_tokens > 0
        unread = 41 - again.prompt_cache_hit_tokens
        assert again.cache_write_tokens == ({"24h": unread} if unread else {})
        assert again.prompt_cache_hit_tokens + again.prompt_cache_miss_tokens == 41
        plain = eng.generate(random_prompt(41, seed=4), GREEDY, tenant="acme").usage
        assert plain.cache_write_tokens == {} and plain.retained_token_seconds == 0
    finally:
        eng.close()


def test_a_tenant_past_its_bound_is_served_and_told_what_was_refused(tmp_path) -> None:
    eng = make_engine(tmp_path, calibrate=False)
    block = eng.layout.nbytes
    eng.close()
    eng = make_engine(tmp_path, calibrate=False, max_retained=8 * block, max_retained_per_tenant=4 * block)
    try:
        ids = random_prompt(41, seed=5)
        u = eng.generate(ids, GREEDY, tenant="small", retain=[RetainSpan(20, "1h"), RetainSpan(None, "5m")]).usage
        # 4 blocks (16 tokens) kept under 1h; the rest of the chain refused
        assert u.cache_write_tokens == {"1h": 16} and u.retention_refused_tokens == 41 - 16
        assert u.prompt_cache_miss_tokens == 41 and len(u.hit_tokens_by_tier) == 4
        assert eng.cache_status()["retention"]["tenants"]["small"]["blocks"] == 4
    finally:
        eng.close()
