"""Fair share of the device pool: a tenant whose admitted streams fill the pool gives pages back
to a tenant below its share (engine/fair_share.py), never below its own share, and the sequence
it gives up resumes with the same tokens and is billed once.

The scheduler tests run a real Scheduler over a real TieredKVCache (no engine thread), stepping as
the engine does; the engine tests run the tiny random-weight Llama with greedy sampling.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.fair_share import FairShare
from engine.model import kv_layout, model_from_config
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from storage.config import CacheConfig
from storage.kv_blocks import RequestBlocks
from storage.tiered_cache import TieredKVCache
from tests.engine.conftest import make_engine, random_prompt, tiny_llama_config
from tieredkv import SamplingParams

BS = 4
POOL = 32


def seq(tenant: str, i: int, prompt: int = 8, max_tokens: int = 100) -> Sequence:
    return Sequence(request_id=f"{tenant}{i}", prompt_ids=random_prompt(prompt, 100 * ord(tenant) + i),
                    params=SamplingParams(max_tokens=max_tokens), tenant=tenant, namespace=tenant.encode(),
                    block_size=BS, max_len=prompt + max_tokens)


def step(sched: Scheduler) -> list[str]:
    """One engine step without a model: advance, append a token to every sequence whose prompt is
    done, finish the ones at max_tokens."""
    out = sched.schedule()
    sched.after_step(out)
    for x in out:
        s = x.seq
        if s.num_computed == s.num_tokens:
            s.output_ids.append(0)
            if len(s.output_ids) == s.params.max_tokens:
                sched.finish(s)
    return [x.seq.request_id for x in out]


def held(sched: Scheduler, tenant: str) -> int:
    return sum(len(s.pages) for s in (*sched.running, *sched.loading) if s.tenant == tenant)


def scheduler() -> tuple[Scheduler, TieredKVCache]:
    layout = kv_layout(model_from_config(tiny_llama_config(), seed=0), BS)
    cache = TieredKVCache(layout, CacheConfig(block_size=BS, host_memory=0, disk_dir=None), num_pages=POOL)
    return Scheduler(cache, max_batch_tokens=64, max_seqs=64), cache


def test_a_starved_tenant_takes_pages_from_the_tenant_over_its_share_and_everyone_finishes() -> None:
    sched, cache = scheduler()
    for i in range(4):
        sched.add(seq("A", i))          # 4 x 108 tokens: 108 pages wanted of 32
    steps = 0
    while sched.preemptions == 0 or cache.pool.num_free > 2:
        step(sched)
        steps += 1
        assert steps < 500
    assert held(sched, "A") >= POOL - 2 and sched.fair_preemptions == 0
    newest = sched.running[-1]
    newest_computed = newest.num_computed
    b = seq("B", 0, prompt=24, max_tokens=4)     # 6 pages for its first chunk: more than are free
    sched.add(b)
    # The next step admits B: A's newest sequence is preempted for it (A keeps at least its
    # share, 16 of 32), and B, a newcomer, runs its prompt in a step of its own.
    assert step(sched) == ["B0"]
    assert sched.fair_preemptions == 1
    assert newest.status is SeqStatus.WAITING and newest.pages == () and sched.waiting[0] is newest
    assert newest.fair_guard == newest_computed + BS
    assert held(sched, "A") >= POOL // 2
    # B decodes every step, first in the batch (A is over its share), until it is done, while
    # A's streams are still running.
    while b.status is not SeqStatus.FINISHED:
        assert step(sched)[0] == "B0"
        assert held(sched, "A") >= POOL // 2
    assert len(b.output_ids) == 4
    assert any(s.tenant == "A" and len(s.output_ids) < 100 for s in (*sched.running, *sched.waiting))
    # No livelock: every A sequence, the preempted one included, finishes.
    a = [s for s in (*sched.running, *sched.waiting)]
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
    assert all(s.status is SeqStatus.FINISHED and len(s.output_ids) == 100 for s in a)
    assert cache.pool.num_free == POOL
    cache.close()


def test_a_tenant_is_never_preempted_below_its_share() -> None:
    sched, cache = scheduler()
    a = seq("A", 0, prompt=100, max_tokens=20)     # one sequence: 25 pages, 30 at its end
    sched.add(a)
    for _ in range(3):              # two chunks of its prompt, a decode
        step(sched)
    assert a.status is SeqStatus.RUNNING and held(sched, "A") == 26 and cache.pool.num_free == 6
    b = seq("B", 0, prompt=28, max_tokens=2)       # 7 pages: more than the pool has left
    b1 = seq("B", 1, prompt=4, max_tokens=2)       # 1 page would fit, but it is behind B0
    sched.add(b)
    sched.add(b1)
    # A is over its share (16), but its only sequence would take it to 0: B waits for A, and
    # B's own later request does not pass B0 (first come, first served within a tenant).
    while a.status is not SeqStatus.FINISHED:
        assert not {"B0", "B1"} & set(step(sched))
        assert b.status is SeqStatus.WAITING and b1.status is SeqStatus.WAITING
    assert sched.fair_preemptions == 0
    while sched.has_work():
        step(sched)
    assert len(b.output_ids) == 2 and len(b1.output_ids) == 2
    cache.close()


def test_a_sequence_preempted_for_fairness_is_guarded_until_it_computes_a_block() -> None:
    fair = FairShare(num_pages=16, block_size=BS)
    hog = [seq("A", i) for i in range(3)]
    for i, s in enumerate(hog):
        s.blocks, s.num_computed = RequestBlocks(list(range(5 * i, 5 * i + 5))), 20   # A holds 15 of 16
    b = seq("B", 0)
    shares = fair.shares(hog, [b])
    assert shares.share == {"A": 8.0, "B": 8.0} and shares.held["A"] == 15
    free = 1
    assert fair.admission_victims(b, 3, lambda n: n <= free, hog, shares) == [hog[2]]   # newest first
    # Needing 11 pages would take A below its share (15 - 10 < 8): nothing is taken.
    assert fair.admission_victims(b, 12, lambda n: n <= free, hog, shares) == []
    fair.taken(hog[2])
    assert hog[2].fair_guard == 20 + BS
    assert fair.admission_victims(b, 3, lambda n: n <= free, hog, shares) == [hog[1]]   # guarded: the next
    hog[2].num_computed = 23
    assert fair.admission_victims(b, 3, lambda n: n <= free, hog, shares) == [hog[1]]
    hog[2].num_computed = 24                                                            # a block further on
    assert fair.admission_victims(b, 3, lambda n: n <= free, hog, shares) == [hog[2]]
    # A tenant at or over its share takes nothing for fairness.
    b.blocks = RequestBlocks(list(range(8)))
    assert fair.admission_victims(b, 3, lambda n: n <= free, hog, fair.shares([*hog, b], [])) == []


def test_weights_divide_the_pool_by_weight_among_the_active_tenants(tmp_path) -> None:
    fair = FairShare(num_pages=40, block_size=BS, weights={"A": 3.0})
    a, b, c = seq("A", 0), seq("B", 0), seq("C", 0)
    assert fair.shares([a], [b]).share == {"A": 30.0, "B": 10.0}
    assert fair.shares([a], [b, c]).share == {"A": 24.0, "B": 8.0, "C": 8.0}
    assert fair.shares([], [b]).share == {"B": 40.0}          # only tenants with requests count
    for bad in ({"A": 0}, {"A": -1.0}, {"A": float("nan")}, {"A": True}, {"A": "2"}):
        with pytest.raises(ValueError, match="tenant_weights"):
            FairShare(num_pages=40, block_size=BS, weights=bad)
    with pytest.raises(ValueError, match="tenant_weights"):     # before the engine opens its cache
        make_engine(tmp_path, tenant_weights={"a": 0})
    assert not (tmp_path / "kv").exists()


GREEDY = SamplingParams(max_tokens=120, ignore_eos=True)
B_PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
A_STREAMS = 6


def test_engine_tenant_b_is_served_while_a_holds_the_pool_and_a_resumes_with_the_same_tokens(tmp_path) -> None:
    a_prompts = [random_prompt(16, seed=300 + i) for i in range(A_STREAMS)]
    b_prompt = random_prompt(60, seed=400)
    with make_engine(tmp_path / "alone", device_memory="1MiB") as eng:      # unpreempted, one at a time
        expected_a = [eng.generate(p, GREEDY, tenant="a").token_ids for p in a_prompts]
        expected_b = eng.generate(b_prompt, B_PARAMS, tenant="b").token_ids
    # 48 pages of 4 tokens: A's six streams of 136 tokens want 204, so A always has a stream
    # waiting to take what another gives back; B's prompt needs 15 pages at once.
    with make_engine(tmp_path / "shared", device_memory=48 * 2048, host_memory="256KiB") as eng, \
            ThreadPoolExecutor(A_STREAMS) as pool:
        a_futures = [pool.submit(eng.generate, p, GREEDY, "a") for p in a_prompts]
        deadline = time.monotonic() + 120
        while eng.scheduler.preemptions < 2:        # A has filled the pool
            assert time.monotonic() < deadline, "A never filled the pool"
            time.sleep(0.005)
        b_out = eng.generate(b_prompt, B_PARAMS, tenant="b")
        a_running_when_b_done = sum(not f.done() for f in a_futures)
        a_outs = [f.result(timeout=600) for f in a_futures]
        fair_preemptions, preemptions = eng.scheduler.fair_preemptions, eng.scheduler.preemptions
        a_bill, b_bill = eng.ledger.tenant("a"), eng.ledger.tenant("b")
        eng.cache.audit()
    # B finished while every one of A's streams still ran (A needs hundreds of steps more).
    assert a_running_when_b_done == A_STREAMS
    assert fair_preemptions >= 1 and preemptions > fair_preemptions
    assert b_out.token_ids == expected_b
    assert [o.token_ids for o in a_outs] == expected_a    # the preempted streams' tokens included
    for o, n in [*((o, 16) for o in a_outs), (b_out, 60)]:
        u = o.usage
        assert u.prompt_tokens == n and u.prompt_cache_hit_tokens + u.prompt_cache_miss_tokens == n
    # Billed once per request: a resumed stream's prompt is not billed again.
    assert (a_bill.requests, a_bill.prompt_tokens, a_bill.completion_tokens) == (A_STREAMS, 16 * A_STREAMS,
                                                                                   120 * A_STREAMS)
    assert a_bill.hit_tokens + a_bill.miss_tokens == 16 * A_STREAMS
    assert (b_bill.requests, b_bill.prompt_tokens, b_bill.completion_tokens) == (1, 60, 4)
