"""Issue 27: a request waits for its remote probe about a round trip, never the load of its bytes;
past that it computes from the front, and a late answer still loads the rest from the back.

A real tiny engine over a real valkey (the session's, each test in a namespace of its own). The
probe's stall is real: the tier's `probe` waits on an Event before asking the store
(test_load_deadline.stall_method). The figures the wait is derived from are fixed by the test
(`Fixed`: a prefill time per token, a round trip and a bandwidth for the store), and time is the
scheduler's injected clock, frozen until the test moves it. No wall-clock bound: waits are hang
guards only. Where a test must see that a late fill never lands in a block the request computed,
the store holds "marked" blocks (noise, stored and verified through the real tier) under the keys
of the blocks it computes before the answer comes: a page holding one would change its tokens.
"""
from __future__ import annotations

import pytest
import torch

from engine.load_deadline import LOAD_MARGIN, PROBE_FRACTION, LoadDeadlines
from engine.model import model_from_config
from storage.config import CacheConfig
from storage.loader import LINKED_WORKERS
from storage.remote.breaker import BreakerConfig
from tests.engine.conftest import random_prompt, reference_greedy, tiny_llama_config
from tests.engine.test_load_deadline import (GUARD_S, Clock, check_usage, drained, in_background, keys_of,
                                             stall_method, wait_until)
from tieredkv import Engine, SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6)
TOKEN_S = 0.01          # a prefill token, as the planner is told
RTT_S = 0.01            # the store's round trip, as the planner is told
BLOCK_S = 1.0           # a block's bytes over the link, as the planner is told
PROBE_SLACK_S = 0.02    # CacheConfig.probe_wait_slack_s's default (the suite's environment sets 60)
# The probe's wait for a 16-block prompt: 3 round trips (under 10% of its recompute, 0.64 s) +
# the slack, 0.05 s. Before: min(1.25 x 0.64, 3 x a one-block load (0.01 + 1.0)) + 0.1 = 0.9 s.
WAIT_S = min(LOAD_MARGIN * RTT_S, PROBE_FRACTION * 16 * BS * TOKEN_S) + PROBE_SLACK_S
OLD_WAIT_S = min(1.25 * 16 * BS * TOKEN_S, LOAD_MARGIN * (RTT_S + BLOCK_S)) + 0.1


class Fixed:
    """The planner's figures: a prefill of TOKEN_S a token; each tier restores after RTT_S at
    BLOCK_S a block."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    def predict(self, new_tokens, context):
        return TOKEN_S * new_tokens

    def seconds(self, tier, nblocks, block_bytes):
        return 0.0 if nblocks <= 0 else RTT_S + BLOCK_S * nblocks * block_bytes / self.block_bytes


class Stepped(Fixed):
    """A step's own cost and a fast store: a chunk of n tokens takes STEP_S + TOKEN_S x n, a
    load of k blocks RTT_S + FAST_BLOCK_S x k."""

    def predict(self, new_tokens, context):
        return STEP_S + TOKEN_S * new_tokens

    def seconds(self, tier, nblocks, block_bytes):
        return 0.0 if nblocks <= 0 else RTT_S + FAST_BLOCK_S * nblocks * block_bytes / self.block_bytes


STEP_S = 0.05
FAST_BLOCK_S = 0.05


def make(tmp_path, figures=Fixed, **kw) -> Engine:
    cache = CacheConfig(block_size=BS, device_memory="256KiB", host_memory="256KiB", disk_dir=None,
                        restore_policy=kw.pop("restore_policy", "load"), probe_wait_slack_s=PROBE_SLACK_S,
                        **{k: kw.pop(k) for k in list(kw) if k.startswith("remote")})
    eng = Engine(model_from_config(tiny_llama_config(), seed=0), cache, exact_hits=False, **kw)
    eng.planner.prefill = eng.planner.rates = figures(eng.layout.nbytes)
    eng.scheduler.clock = Clock()
    return eng


def cold_blocks(tmp_path, prompt, tenant: str) -> list[torch.Tensor]:
    with make(tmp_path / "cold") as cold:
        cold.generate(prompt, GREEDY, tenant=tenant)
        return [cold.cache.pool.kv[cold.cache.pool.page_of(k)].clone() for k in keys_of(cold, prompt, tenant)]


def store(eng, keys, blocks) -> None:
    for k, block in zip(keys, blocks):
        assert eng.cache.remote.put(k, block, wait=True)
    assert eng.cache.remote.drain()


def mark(eng) -> torch.Tensor:
    return torch.randn(eng.layout.shape, generator=torch.Generator().manual_seed(7)).to(eng.layout.dtype)


def waiting_for_probe(eng, prompt) -> bool:
    return any(s.prompt_ids == prompt and s.probe_deadline is not None for s in list(eng.scheduler.waiting))


def test_a_probes_wait_is_a_round_trip_and_never_more_than_a_fraction_of_the_recompute() -> None:
    # 8 blocks: recompute 2 s, a load of all their bytes 0.5 s, a round trip of the store 5 ms.
    rule = LoadDeadlines(lambda start, end: 2.0, load_seconds=lambda tiers: 0.5, round_trip_s=lambda tier: 0.005,
                         probe_slack_s=0.02)
    assert rule.probe_seconds(8) == pytest.approx(LOAD_MARGIN * 0.005 + 0.02)     # not 3 x 0.5 + 0.1
    far = LoadDeadlines(lambda start, end: 0.3, round_trip_s=lambda tier: 1.0, probe_slack_s=0.02)   # a far store
    assert far.probe_seconds(8) == pytest.approx(PROBE_FRACTION * 0.3 + 0.02)
    no_figure = LoadDeadlines(lambda start, end: 0.3, round_trip_s=lambda tier: None, probe_slack_s=0.0)
    assert no_figure.probe_seconds(8) == pytest.approx(PROBE_FRACTION * 0.3)
    no_prefill = LoadDeadlines(lambda start, end: None, fallback_s=0.5, probe_slack_s=0.0)
    assert no_prefill.probe_seconds(8) == pytest.approx(PROBE_FRACTION * 0.5)
    with pytest.raises(ValueError, match="probe_slack_s"):
        LoadDeadlines(lambda start, end: None, probe_slack_s=-1.0)


def test_a_stalled_probe_is_waited_for_a_round_trip_then_the_request_computes(tmp_path, valkey) -> None:
    """(a) The store holds the prompt but its probe stalls: the request starts computing once
    the round-trip bound passed (not the old bound of a load of every block's bytes), and its
    tokens are a cold run's, billed as computed."""
    tenant = "probe-wait-stalled"
    prompt = random_prompt(16 * BS + 1, seed=61)
    blocks = cold_blocks(tmp_path, prompt, tenant)
    with make(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S) as eng:
        store(eng, keys_of(eng, prompt, tenant), blocks)
        release, reached = stall_method(eng.cache.remote, "probe")
        clock = eng.scheduler.clock
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant=tenant))
            wait_until(lambda: reached.is_set() and waiting_for_probe(eng, prompt), "its first turn, probe stalled")
            deadline = next(s.probe_deadline for s in list(eng.scheduler.waiting) if s.prompt_ids == prompt)
            assert "result" not in got
            clock.now = WAIT_S * 1.01 + 1e-6          # past the round-trip bound, far before the old one
            t.join(GUARD_S)
            done_while_stalled = "result" in got and not release.is_set()
        finally:
            release.set()
        wait_until(lambda: drained(eng), "every page comes back")
        probes = eng.cache_status()["cost_model"]["load_deadline"]
        eng.cache.audit()
    assert deadline == pytest.approx(WAIT_S) and WAIT_S < OLD_WAIT_S / 10
    assert done_while_stalled
    out = got["result"]
    assert out.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    check_usage(out, prompt, {})
    assert out.usage.prompt_cache_miss_tokens == len(prompt)
    assert probes["probes_abandoned"] == 1 and probes["late_probe_loads"] == 0


def run_with_late_answer(eng, prompt, tenant, release, answer_at: int) -> tuple[dict, list]:
    """Generate `prompt`; past its probe's wait it computes, and its stalled probe is answered
    on the engine thread once it computed `answer_at` tokens (before its next step is
    scheduled). Returns its result and, for each back load it joined, (the back's pages, the
    pages it computed into)."""
    seen: list = []
    sched = eng.scheduler
    real_after, real_join = sched.after_step, sched._join

    def after_step(scheduled) -> None:
        real_after(scheduled)
        for s in scheduled:
            seq = s.seq
            if seq.prompt_ids == prompt and seq.num_computed >= answer_at and not release.is_set():
                release.set()
                assert seq.probe.done.wait(GUARD_S), "the released probe answers"

    def join(seq, abandon: bool = False) -> None:
        if seq.prompt_ids == prompt:
            seen.append((list(seq.load.pages), list(seq.pages)))
        real_join(seq, abandon)
    sched.after_step, sched._join = after_step, join
    try:
        t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant=tenant))
        wait_until(lambda: waiting_for_probe(eng, prompt), "its first turn, probe stalled")
        sched.clock.now += WAIT_S * 1.01 + 1e-6
        t.join(GUARD_S)
    finally:
        del sched.after_step, sched._join
        release.set()
    return got, seen


def test_a_late_answer_loads_the_blocks_not_computed_yet_and_never_the_computed_ones(tmp_path, valkey) -> None:
    """(b) The probe answers after the first chunk (2 blocks) was computed: the store's other 14
    blocks are loaded from the back, the 2 computed are not (the store holds marked blocks under
    their keys: loading one would change the tokens), the tokens are a cold run's and the bill
    splits exactly: 14 blocks from the store, the rest computed."""
    tenant = "probe-wait-late"
    prompt = random_prompt(16 * BS + 1, seed=60)
    blocks = cold_blocks(tmp_path, prompt, tenant)
    with make(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S, max_batch_tokens=2 * BS) as eng:
        keys = keys_of(eng, prompt, tenant)
        store(eng, keys, [mark(eng)] * 2 + blocks[2:])
        release, _ = stall_method(eng.cache.remote, "probe")
        before = eng.cache.stats()["remote"]
        got, seen = run_with_late_answer(eng, prompt, tenant, release, answer_at=2 * BS)
        after = eng.cache.stats()["remote"]
        wait_until(lambda: drained(eng), "every page comes back")
        probes = eng.cache_status()["cost_model"]["load_deadline"]
        eng.cache.audit()
    out = got["result"]
    assert out.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    check_usage(out, prompt, {"remote": 14 * BS})
    assert out.usage.prompt_cache_miss_tokens == len(prompt) - 14 * BS
    assert after.promotions - before.promotions == 14          # blocks 2..15, read once each
    assert len(seen) == 1
    back, computed = seen[0]
    assert len(back) == 14 and len(computed) == 2 and not set(back) & set(computed)
    assert (probes["probes_abandoned"], probes["late_probe_loads"], probes["late_probe_blocks"]) == (1, 1, 14)


def test_a_late_answer_is_planned_with_its_suffix_so_a_back_that_would_cost_a_step_is_computed(tmp_path, valkey) -> None:
    """Under `auto`, the probe answers once 14 of the prompt's 15 blocks are computed: what is
    left is block 14 and a 3-token suffix, 7 tokens, one chunk (0.05 + 0.07 = 0.12 s). Loading
    block 14 (0.06 s) joins first and then runs the suffix in a step of its own (0.08 s), so it is
    charged that step, as admission's split is (engine/restore_planner.py): the planner
    recomputes, the late answer goes unused, and the bill is all computed. Before, late() planned
    without the suffix: the load (0.06 s) beat computing block 14 (0.09 s) and the back loaded."""
    tenant = "probe-wait-late-suffix"
    prompt = random_prompt(15 * BS + 3, seed=65)
    blocks = cold_blocks(tmp_path, prompt, tenant)
    with make(tmp_path, figures=Stepped, restore_policy="auto", remote_url=valkey.url, remote_timeout_s=GUARD_S,
              max_batch_tokens=2 * BS) as eng:
        store(eng, keys_of(eng, prompt, tenant), blocks)
        release, _ = stall_method(eng.cache.remote, "probe")
        split = eng.planner.split(["device"] * 14 + ["remote"], suffix_tokens=3)
        unsuffixed = eng.planner.split(["device"] * 14 + ["remote"])
        got, seen = run_with_late_answer(eng, prompt, tenant, release, answer_at=14 * BS)
        wait_until(lambda: drained(eng), "every page comes back")
        probes = eng.cache_status()["cost_model"]["load_deadline"]
        eng.cache.audit()
    # The planner's two answers for what late() sees: loading block 14 wins without the suffix
    # (0.06 s against 0.09 s), loses with it (0.06 + 0.08 s against one 7-token chunk, 0.12 s).
    assert (unsuffixed.start, split.start) == (14, 15)
    out = got["result"]
    assert out.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    check_usage(out, prompt, {})
    assert out.usage.prompt_cache_miss_tokens == len(prompt)
    assert seen == []
    assert (probes["probes_abandoned"], probes["late_probe_loads"], probes["late_probes_unused"]) == (1, 0, 1)


def test_late_probes_leave_the_breaker_closed_and_the_store_in_use(tmp_path, valkey) -> None:
    """(c) With a breaker that opens at the first failure: one probe answered only after its
    request finished, one answered after its first chunk. Neither is the store's failure: the
    breaker stays closed, the second's late answer is loaded, and a third request, answered in
    time, loads from the store."""
    tenant = "probe-wait-breaker"
    prompts = [random_prompt(16 * BS + 1, seed=63 + i) for i in range(3)]
    cold = [cold_blocks(tmp_path / str(i), p, tenant) for i, p in enumerate(prompts)]
    with make(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S, max_batch_tokens=2 * BS) as eng:
        for p, blocks in zip(prompts, cold):
            store(eng, keys_of(eng, p, tenant), blocks)
        remote = eng.cache.remote
        remote.breaker.config = BreakerConfig(failures_to_open=1, cooldown_s=3600)
        release, reached = stall_method(remote, "probe")
        t, got0 = in_background(lambda: eng.generate(prompts[0], GREEDY, tenant=tenant))
        wait_until(lambda: reached.is_set() and waiting_for_probe(eng, prompts[0]), "the first probe stalled")
        first = next(s for s in list(eng.scheduler.waiting) if s.prompt_ids == prompts[0])
        eng.scheduler.clock.now += WAIT_S * 1.01 + 1e-6
        t.join(GUARD_S)
        answered_after = "result" in got0 and not release.is_set()
        release.set()                                  # its answer comes after it finished
        assert first.probe.done.wait(GUARD_S)
        release, _ = stall_method(remote, "probe")
        got1, _ = run_with_late_answer(eng, prompts[1], tenant, release, answer_at=2 * BS)
        del remote.probe                               # the store answers in time again
        third = eng.generate(prompts[2], GREEDY, tenant=tenant)
        status = eng.cache_status()
        wait_until(lambda: drained(eng), "every page comes back")
    tier = status["tiers"]["remote"]
    assert answered_after
    assert tier["breaker"] == "closed" and tier["breaker_opened"] == 0 and tier["errors"] == 0
    for out, p in zip((got0["result"], got1["result"], third), prompts):
        assert out.token_ids == reference_greedy(None, p, GREEDY.max_tokens)
    check_usage(got0["result"], prompts[0], {})
    check_usage(got1["result"], prompts[1], {"remote": 14 * BS})
    check_usage(third, prompts[2], {"remote": 16 * BS})
    assert status["cost_model"]["load_deadline"]["probes_abandoned"] == 2


def test_a_late_answers_back_past_its_deadline_is_computed_and_its_late_blocks_never_land_in_it(tmp_path, valkey) -> None:
    """A late answer's back load is a load like any: its read stalls, its deadline passes, the
    sequence computes the back itself (billed as computed: nothing was served), and the blocks
    that arrive afterwards -- marked ones: the store holds noise under every key -- are dropped,
    never written into a page it computed: the next request hits the computed blocks and its
    tokens are a cold run's."""
    tenant = "probe-wait-late-stalled"
    prompt = random_prompt(16 * BS + 1, seed=64)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S, max_batch_tokens=2 * BS) as eng:
        keys = keys_of(eng, prompt, tenant)
        store(eng, keys, [mark(eng)] * len(keys))
        remote, sched = eng.cache.remote, eng.scheduler
        release_probe, _ = stall_method(remote, "probe")
        release_read, read_reached = stall_method(remote, "get_many")
        real_after = sched.after_step

        def after_step(scheduled) -> None:
            real_after(scheduled)
            for s in scheduled:
                if s.seq.prompt_ids == prompt and s.seq.num_computed >= 2 * BS and not release_probe.is_set():
                    release_probe.set()
                    assert s.seq.probe.done.wait(GUARD_S), "the released probe answers"
        sched.after_step = after_step
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant=tenant))
            wait_until(lambda: waiting_for_probe(eng, prompt), "its first turn, probe stalled")
            sched.clock.now += WAIT_S * 1.01 + 1e-6
            wait_until(lambda: read_reached.is_set() and any(s.load is not None for s in list(sched.running)),
                       "the late answer's back is loading, its read stalled")
            assert "result" not in got
            sched.clock.now += 3600.0                     # past the back's deadline
            t.join(GUARD_S)
            done_while_stalled = "result" in got and not release_read.is_set()
        finally:
            del sched.after_step
            release_probe.set()
            release_read.set()                            # the marked blocks arrive now, late
        wait_until(lambda: drained(eng), "the late fills end and give their pages back")
        again = eng.generate(prompt, GREEDY, tenant=tenant)
        status = eng.cache_status()
        eng.cache.audit()
    assert done_while_stalled
    out = got["result"]
    assert out.token_ids == expected
    check_usage(out, prompt, {})                          # the back did not arrive: computed
    assert out.usage.prompt_cache_miss_tokens == len(prompt)
    assert status["cost_model"]["load_deadline"]["late_probe_loads"] == 1
    assert (status["tiers"]["remote"]["abandoned"], status["tiers"]["remote"]["abandoned_loads"]) == (14, 1)
    assert again.token_ids == expected                    # the cache holds the computed blocks, not marks
    assert again.usage.hit_tokens_by_tier["device"] == 16 * BS


def test_stalled_probes_in_a_row_each_wait_their_own_round_trip_whatever_the_policy(tmp_path, valkey) -> None:
    """Issue 27, run 4b's stalled row (auto ~2 s where load and recompute took 0.25-0.74 s, hit 0
    every time), as bench_ttft's round runs it: requests one after the other, the store stalled
    for all of them, the policy switched between them (load, recompute, auto, then auto first),
    every earlier probe still stuck -- so from the third on, every remote worker
    (storage/loader.py LINKED_WORKERS) is held and the request's probe never even starts. Each is
    admitted when the scheduler's clock reaches its own probe wait (the clock moves only when the
    test moves it, so no other wait -- back-pressure, a breaker, a worker, a store timeout --
    gates it), computes, and the breaker is never asked (the store was never called)."""
    prompts = [random_prompt(16 * BS + 1, seed=70 + i) for i in range(4)]
    with make(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S) as eng:
        release, _ = stall_method(eng.cache.remote, "probe")
        started, stalled = [], eng.cache.remote.probe
        eng.cache.remote.probe = lambda keys: (started.append(len(keys)), stalled(keys))[1]
        clock, sched = eng.scheduler.clock, eng.scheduler
        waits = []
        try:
            for prompt, policy in zip(prompts, ("load", "recompute", "auto", "auto")):
                eng.planner.policy = policy
                t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant="probe-wait-row"))
                wait_until(lambda: waiting_for_probe(eng, prompt), f"{policy}: its first turn, probe stalled")
                seq = next(s for s in list(sched.waiting) if s.prompt_ids == prompt)
                waits.append(seq.probe_deadline - clock.now)
                clock.now = seq.probe_deadline          # no further: admitted at its own wait
                t.join(GUARD_S)
                assert "result" in got and not release.is_set(), f"{policy}: admitted at its probe's wait"
                assert got["result"].token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
                assert sched.loads_in_flight() == 0 and not sched.loading
                clock.now += 1.0
            stats = eng.cache.remote.stats()
            assert len(started) == LINKED_WORKERS      # the last two probes never started
        finally:
            release.set()
        wait_until(lambda: drained(eng), "every page comes back")
        probes = eng.cache_status()["cost_model"]["load_deadline"]
    assert waits == pytest.approx([WAIT_S] * 4)
    assert probes["probes_abandoned"] == 4
    assert stats.breaker == "closed" and stats.errors == 0 and stats.skipped == 0
