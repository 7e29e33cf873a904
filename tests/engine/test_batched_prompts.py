"""Issue 29, item 3 in the engine: a batch of prompts in one call (Engine.generate/stream with a
list of prompts). Each prompt is its own request, billed on its own; a batch is queued whole
or not at all; a streamed batch's chunks are indexed prompt-major (index = prompt_index * n +
choice, OpenAI's order) and carry the same tokens as the prompts run alone; closing it bills
each choice for the chunks it yielded. Real tiny engines, real pool, LMDB ledger."""
from __future__ import annotations

import time

import pytest

from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

PROMPTS = [random_prompt(n, seed=60 + n) for n in (9, 14, 6)]
SEEDED = SamplingParams(max_tokens=5, temperature=1.0, seed=31, n=2, ignore_eos=True)


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_streamed_batch_is_indexed_prompt_major_with_each_prompt_billed(tmp_path):
    with make_engine(tmp_path / "alone") as alone:
        solo = [alone.generate(p, SEEDED) for p in PROMPTS]       # each prompt on its own
    with make_engine(tmp_path / "batch") as eng:
        chunks = list(eng.stream(PROMPTS, SEEDED, tenant="t-batch"))
        assert sorted({c.index for c in chunks}) == list(range(6))
        for i, outs in enumerate(solo):
            for j, out in enumerate(outs):
                mine = [c for c in chunks if c.index == i * 2 + j]
                assert [t for c in mine for t in c.token_ids] == out.token_ids
                assert len({c.request_id for c in mine}) == 1
                # each choice's last chunk carries its own prompt's usage
                assert mine[-1].usage.prompt_tokens == len(PROMPTS[i]) and mine[-1].usage.completion_tokens == 10
        assert len({c.request_id for c in chunks}) == 3                 # three requests...
        bill = eng.ledger.tenant("t-batch")                              # ...each billed once
        assert (bill.requests, bill.prompt_tokens, bill.completion_tokens) == (3, sum(map(len, PROMPTS)), 30)
        # generate with the same batch gives the prompts' choices, per prompt.
        outs = eng.generate(PROMPTS, SEEDED)
        assert [[o.token_ids for o in per] for per in outs] == [[o.token_ids for o in per] for per in solo]
        assert eng._inflight == 0 and eng.cache.pool.stats().in_use_pages == 0


def test_a_batch_with_one_bad_prompt_queues_none_of_it(tmp_path):
    with make_engine(tmp_path) as eng:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.stream([PROMPTS[0], [1, 2, 10**6]], SEEDED, tenant="t-bad").__next__()
        with pytest.raises(ValueError, match="max_queue"):
            eng.generate([PROMPTS[0]] * (eng.max_queue + 1), SEEDED)
        assert eng._inflight == 0 and not eng.scheduler.waiting and eng.ledger.tenant("t-bad").requests == 0


def test_closing_a_streamed_batch_bills_each_choice_what_it_yielded(tmp_path):
    long = SamplingParams(max_tokens=300, temperature=1.0, seed=5, n=2, ignore_eos=True)
    with make_engine(tmp_path, device_memory="1MiB") as eng:
        stream = eng.stream(PROMPTS[:2], long, tenant="t-batch-gone")
        got = [next(stream) for _ in range(9)]
        stream.close()
        wait_for(lambda: eng.ledger.tenant("t-batch-gone").requests == 2)
        wait_for(lambda: not eng.scheduler.running and eng._inflight == 0)
        records = dict(eng.ledger.records())
        for i in range(2):
            rid = {c.request_id for c in got if c.index // 2 == i}
            yielded = sum(len(c.token_ids) for c in got if c.index // 2 == i)
            if rid:
                assert records[rid.pop()]["completion_tokens"] == yielded
        assert eng.ledger.tenant("t-batch-gone").completion_tokens == sum(len(c.token_ids) for c in got) == 9
        assert eng.cache.pool.stats().in_use_pages == 0
