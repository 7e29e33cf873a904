"""Issue 8, item 2: one request never fails another.

The reproduction from the issue: one tenant sends temperature=1e-38 / top_p=1e-46 while another
tenant's requests are decoding. Before, the sampler produced NaN probabilities, the step raised,
and the engine failed every running sequence of the batch. Real tiny model, real engine.
"""
from __future__ import annotations

import threading

import pytest
import torch

from engine.sampler import SamplingError, sample
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams


def run_all(eng, jobs):
    """Submit every (prompt, params, tenant[, "stream"]) at once, each from its own thread; results
    or exceptions. A streamed job's result is (token ids, finish_reason, request id) from its chunks."""
    results: list = [None] * len(jobs)

    def one(i, prompt, params, tenant, mode="generate"):
        try:
            if mode == "stream":
                chunks = list(eng.stream(prompt, params, tenant=tenant))
                results[i] = ([t for c in chunks for t in c.token_ids], chunks[-1].finish_reason,
                              chunks[-1].request_id)
            else:
                results[i] = eng.generate(prompt, params, tenant=tenant)
        except Exception as e:   # recorded, asserted on below
            results[i] = e
    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("hostile", [SamplingParams(max_tokens=8, temperature=1e-38),
                                     SamplingParams(max_tokens=8, temperature=0.7, top_p=1e-46, seed=1),
                                     SamplingParams(max_tokens=8, temperature=1e-38, top_p=1e-46, top_k=1)])
def test_a_tenants_extreme_sampling_fails_no_other_request(tmp_path, hostile) -> None:
    prompts = [random_prompt(9 + 3 * i, seed=40 + i) for i in range(4)]
    greedy = SamplingParams(max_tokens=24)
    with make_engine(tmp_path / "alone", disk=False) as eng:
        expected = [eng.generate(p, greedy, tenant="alice").token_ids for p in prompts]
    with make_engine(tmp_path) as eng:
        # The victims: two JSON-style (generate) and two SSE-style (stream) requests.
        jobs = [(p, greedy, "alice", "stream" if i % 2 else "generate") for i, p in enumerate(prompts)]
        results = run_all(eng, jobs + [(random_prompt(11, seed=7), hostile, "mallory")])
        assert not any(isinstance(r, Exception) for r in results), results
        for i, r in enumerate(results[:4]):
            if i % 2:
                assert r[0] == expected[i] and r[1] == "length"
            else:
                assert r.token_ids == expected[i] and r.finish_reason == "length"
        mallory = results[4]
        assert len(mallory.token_ids) == 8 and mallory.finish_reason == "length"
        # Every request billed once, the hostile one included (the issue: it was not billed).
        for rid in [r[2] if i % 2 else r.request_id for i, r in enumerate(results[:4])] + [mallory.request_id]:
            assert eng.ledger.has(rid)
        assert eng.ledger.tenant("alice").requests == 4 and eng.ledger.tenant("mallory").requests == 1
        assert eng.cache.pool.num_free == eng.cache.pool.num_pages
        eng.cache.audit()


def test_tiny_temperature_is_greedy_and_top_p_keeps_the_top_token() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=1e-38), None) == 1
    assert sample(logits, SamplingParams(temperature=1e-30, top_p=1e-46), None) == 1
    for _ in range(20):
        assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-46), g) == 1
    with pytest.raises(SamplingError):
        sample(torch.tensor([float("nan"), 1.0]), SamplingParams(temperature=1.0), g)
    assert sample(torch.tensor([float("-inf"), float("inf"), 0.0]), SamplingParams(temperature=1.0), g) == 1


def test_a_failure_while_handling_one_sequence_fails_only_that_one(tmp_path) -> None:
    # A fault injected into the token handling of one request (as a tokenizer or stop-string
    # bug would raise): that request fails with the error, the others complete unchanged.
    prompts = [random_prompt(10 + i, seed=60 + i) for i in range(3)]
    greedy = SamplingParams(max_tokens=12)
    with make_engine(tmp_path / "alone", disk=False) as eng:
        expected = [eng.generate(p, greedy).token_ids for p in prompts]
    with make_engine(tmp_path) as eng:
        victim = random_prompt(13, seed=99)
        handle = eng._after_token

        def after_token(seq, token):
            if seq.prompt_ids == victim and len(seq.output_ids) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            handle(seq, token)
        eng._after_token = after_token
        results = run_all(eng, [(p, greedy, "default") for p in prompts] + [(victim, greedy, "default")])
        assert [r.token_ids for r in results[:3]] == expected
        assert isinstance(results[3], RuntimeError) and "injected" in str(results[3])
        assert eng.cache.pool.num_free == eng.cache.pool.num_pages
        assert eng._inflight == 0
        eng.cache.audit()


def test_a_failure_while_finishing_a_request_fails_it_alone_and_leaves_nothing_counted(tmp_path, monkeypatch) -> None:
    # A fault after the scheduler let go of the sequence (building the result): that caller gets
    # the error, the engine's in-flight count is back to 0 (close would otherwise wait it out),
    # and the next request is served.
    import engine.output_stream as output_module   # builds the finished request's result
    real, calls = output_module.RequestMetrics, []

    def metrics(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("injected")
        return real(*a, **kw)
    monkeypatch.setattr(output_module, "RequestMetrics", metrics)
    with make_engine(tmp_path) as eng:
        with pytest.raises(RuntimeError, match="injected"):
            eng.generate(random_prompt(9, seed=5), SamplingParams(max_tokens=3))
        assert eng._inflight == 0
        assert len(eng.generate(random_prompt(9, seed=6), SamplingParams(max_tokens=3)).token_ids) == 3
        assert eng._inflight == 0
        assert eng.cache.pool.num_free == eng.cache.pool.num_pages
