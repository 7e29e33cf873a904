"""Scheduler admission takes tenants in turns: one tenant's flood of waiting requests delays
another tenant's request by at most one admission, never by the whole flood.

The scheduler runs over a real TieredKVCache (no engine thread): each test step advances the
scheduled tokens and appends a token for every sequence whose prompt is done, as the engine does.
"""
from __future__ import annotations

from engine.model import kv_layout, model_from_config
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from storage.config import CacheConfig
from storage.tiered_cache import TieredKVCache
from tests.engine.conftest import random_prompt, tiny_llama_config
from tieredkv import SamplingParams

BS = 4
PROMPT = 8
PARAMS = SamplingParams(max_tokens=30)


def seq(tenant: str, i: int) -> Sequence:
    return Sequence(request_id=f"{tenant}{i}", prompt_ids=random_prompt(PROMPT, 100 * ord(tenant) + i), params=PARAMS,
                    tenant=tenant, namespace=tenant.encode(), block_size=BS, max_len=PROMPT + 30)


def step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.after_step(out)
    for x in out:
        if x.seq.num_computed == x.seq.num_tokens:
            x.seq.output_ids.append(0)
    return [x.seq.request_id for x in out]


def scheduler(budget: int) -> tuple[Scheduler, TieredKVCache]:
    layout = kv_layout(model_from_config(tiny_llama_config(), seed=0), BS)
    cache = TieredKVCache(layout, CacheConfig(block_size=BS, host_memory=0, disk_dir=None), num_pages=256)
    return Scheduler(cache, max_batch_tokens=budget, max_seqs=64), cache


def test_a_tenant_arriving_behind_a_flood_is_admitted_in_the_next_round() -> None:
    sched, cache = scheduler(budget=2 * PROMPT)
    for i in range(20):
        sched.add(seq("A", i))
    assert step(sched) == ["A0", "A1"]           # two prompts fill the budget
    sched.add(seq("B", 0))                       # arrives last, 18 of A's ahead of it
    # The next round admits B (no sequence running) before A's third, and A2 gets the budget's
    # rest; B is a newcomer (nothing running or loading), so its first chunk runs in a step of
    # its own. First come, first served gave ["A0", "A1", "A2", "A3"].
    assert step(sched) == ["B0"]
    assert [s.request_id for s in sched.running] == ["A0", "A1", "B0", "A2"]
    assert [s.request_id for s in sched.waiting][:3] == ["A3", "A4", "A5"]   # FIFO within A
    # Then everyone (never two newcomer steps in a row): three decodes, the rest of A2's prompt,
    # and A3's first chunk in what is left of the budget.
    assert step(sched) == ["A0", "A1", "B0", "A2", "A3"]
    assert sched.newcomer_steps == 1
    cache.close()


def test_tenants_alternate_while_none_is_running() -> None:
    sched, cache = scheduler(budget=5 * PROMPT)
    for i in range(4):
        sched.add(seq("A", i))
    sched.add(seq("B", 0))
    sched.add(seq("B", 1))
    sched.add(seq("C", 0))
    # Ties (none running, none admitted yet) go to the tenant first in line; then the fewest
    # running first, the least recently admitted among equals.
    assert step(sched) == ["A0", "B0", "C0", "A1", "B1"]
    assert [s.request_id for s in sched.waiting] == ["A2", "A3"]
    cache.close()
