"""Aborting a request whose caller left (engine/abort.py): its sequence ends within a step, every
page it held goes back, and it is billed for the prompt as served and the tokens delivered."""
from __future__ import annotations

import threading
import time

import pytest

from engine.abort import CALLER_CLOSED, CLIENT_DISCONNECTED, AbortHandle
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def pages_held(eng) -> int:
    pool = eng.cache.pool
    return sum(pool.refcount(p) for p in range(pool.num_pages))


def record_of(eng, request_id: str) -> dict:
    return dict(eng.ledger.records())[request_id]


def test_closing_a_stream_aborts_its_sequence_and_bills_the_chunks_it_yielded(tmp_path):
    with make_engine(tmp_path, device_memory="1MiB") as eng:
        prompt = random_prompt(13, seed=1)
        stream = eng.stream(prompt, LONG, tenant="t-closed")
        got = [next(stream), next(stream), next(stream)]
        stream.close()                       # the caller is gone after 3 chunks
        wait_for(lambda: eng.cache_status()["engine"]["aborted"].get(CALLER_CLOSED) == 1)
        wait_for(lambda: not eng.scheduler.running and eng.ledger.tenant("t-closed").requests == 1)
        assert pages_held(eng) == 0          # every page back (its full blocks stay cached, refcount 0)
        rec = record_of(eng, got[0].request_id)
        assert rec["completion_tokens"] == sum(len(c.token_ids) for c in got) == 3
        assert rec["prompt_tokens"] == 13     # admitted: the prompt was served in full
        assert rec["miss_tokens"] + sum(rec["hit_tokens_by_tier"].values()) == 13
        # The engine goes on serving, and the next request is unaffected.
        assert len(eng.generate(prompt, SamplingParams(max_tokens=3)).token_ids) == 3


def test_an_abort_from_another_thread_ends_a_generate_call_with_finish_reason_abort(tmp_path):
    with make_engine(tmp_path, device_memory="1MiB") as eng:
        handle = AbortHandle()
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("out", eng.generate(random_prompt(9, seed=2), LONG,
                                                                                  tenant="t-gone", abort=handle)))
        t.start()
        wait_for(lambda: any(s.output_ids for s in list(eng.scheduler.running)))
        assert handle.abort(CLIENT_DISCONNECTED, delivered_tokens=0)
        assert not handle.abort(CLIENT_DISCONNECTED, 5)      # the first abort stands
        t.join(timeout=60)
        out = result["out"]
        assert out.finish_reason == "abort"
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == 9
        assert 0 < len(out.token_ids) < 400               # generated some, stopped well before its cap
        assert record_of(eng, out.request_id)["completion_tokens"] == 0
        assert eng.cache_status()["engine"]["aborted"] == {CLIENT_DISCONNECTED: 1}
        assert not eng.scheduler.running and pages_held(eng) == 0 and eng._inflight == 0


def test_an_abort_before_admission_bills_nothing_served_and_the_bill_is_still_written(tmp_path):
    with make_engine(tmp_path) as eng:
        handle = AbortHandle()
        handle.abort(CLIENT_DISCONNECTED, 0)         # before the engine ever saw the request
        out = eng.generate(random_prompt(11, seed=3), LONG, tenant="t-early", abort=handle)
        assert out.finish_reason == "abort" and out.token_ids == []
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.prompt_cache_miss_tokens) == (0, 0, 0)
        bill = eng.ledger.tenant("t-early")
        assert (bill.requests, bill.prompt_tokens, bill.completion_tokens) == (1, 0, 0)
        assert eng._inflight == 0 and not eng.scheduler.waiting


def test_a_handle_serves_one_request(tmp_path):
    with make_engine(tmp_path) as eng:
        handle = AbortHandle()
        eng.generate(random_prompt(5, seed=4), SamplingParams(max_tokens=2), abort=handle)
        with pytest.raises(ValueError, match="AbortHandle"):
            eng.generate(random_prompt(5, seed=5), SamplingParams(max_tokens=2), abort=handle)
        with pytest.raises(ValueError, match="AbortHandle"):      # a batch's call too: nothing queued
            eng.generate([random_prompt(5, seed=6), random_prompt(5, seed=7)], abort=handle)
        assert eng._inflight == 0
        # An abort after the request finished changes nothing: its bill stands.
        assert handle.abort(CLIENT_DISCONNECTED, 0)
        assert eng.cache_status()["engine"]["aborted"] == {}


CHOICES = SamplingParams(max_tokens=400, ignore_eos=True, n=3, temperature=1.0, seed=9)


def test_closing_an_n_choice_stream_bills_each_choice_the_chunks_it_yielded(tmp_path):
    """n > 1 is billed as one request's abort is: each choice for the tokens that reached the
    caller, not every token it generated (the engine runs a step or more ahead of the caller)."""
    with make_engine(tmp_path, device_memory="1MiB") as eng:
        stream = eng.stream(random_prompt(13, seed=21), CHOICES, tenant="t-choices")
        got = [next(stream) for _ in range(7)]
        stream.close()
        wait_for(lambda: eng.ledger.tenant("t-choices").requests == 1)
        wait_for(lambda: not eng.scheduler.running and eng._inflight == 0)
        rec = record_of(eng, got[0].request_id)
        # Every step samples a token for each of the 3 choices, so at least 9 were generated.
        assert rec["completion_tokens"] == sum(len(c.token_ids) for c in got) == 7
        assert rec["prompt_tokens"] == 13
        assert pages_held(eng) == 0
        assert eng.cache_status()["engine"]["aborted"] == {CALLER_CLOSED: 1}


def test_an_n_choice_request_abandoned_before_its_response_bills_no_completion(tmp_path):
    with make_engine(tmp_path, device_memory="1MiB") as eng:
        handle = AbortHandle()
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("outs", eng.generate(
            random_prompt(9, seed=22), CHOICES, tenant="t-choices-gone", abort=handle)))
        t.start()
        wait_for(lambda: sum(len(s.output_ids) for s in list(eng.scheduler.running)) >= 6)
        assert handle.abort(CLIENT_DISCONNECTED, delivered_tokens=0)     # none of it reached the client
        t.join(timeout=60)
        outs = result["outs"]
        assert [o.finish_reason for o in outs] == ["abort"] * 3 and all(o.token_ids for o in outs)
        assert outs[0].usage.completion_tokens == 0 and outs[0].usage.prompt_tokens == 9
        assert record_of(eng, outs[0].request_id)["completion_tokens"] == 0
        assert not eng.scheduler.running and pages_held(eng) == 0 and eng._inflight == 0


def test_delivered_counts_are_checked():
    with pytest.raises(ValueError, match="delivered_tokens"):
        AbortHandle().abort(CLIENT_DISCONNECTED, (1, -1))
    assert AbortHandle().abort(CLIENT_DISCONNECTED, [1, 2])
