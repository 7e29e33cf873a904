"""Scheduler.decode_step_tokens: while a sequence decodes, every step stays within the budget,
decodes are never left out, and prefills go on in chunks; greedy outputs do not change. Without it
(the default), a long prefill ahead of a decoder in the step's order still leaves it its token.

The scheduler runs over a real TieredKVCache (no engine thread): each test step advances the
scheduled tokens and appends a token for every sequence whose prompt is done, as the engine does.
"""
from __future__ import annotations

from engine.model import kv_layout, model_from_config
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from storage.config import CacheConfig
from storage.tiered_cache import TieredKVCache
from tests.engine.conftest import make_engine, random_prompt, tiny_llama_config
from tieredkv import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=30)


def seq(n: int, seed: int, tenant: str = "t") -> Sequence:
    return Sequence(request_id=f"r{seed}", prompt_ids=random_prompt(n, seed), params=PARAMS, tenant=tenant,
                    namespace=b"ns", block_size=BS, max_len=n + 30)


def _run(sched: Scheduler, until) -> list[dict[str, int]]:
    """Steps as the engine takes them (a token for each sequence whose prompt is done) until `until()`."""
    steps = []
    while not until():
        out = sched.schedule()
        steps.append({x.seq.request_id: x.num_tokens for x in out})
        sched.after_step(out)
        for x in out:
            if x.seq.num_computed == x.seq.num_tokens:
                x.seq.output_ids.append(0)
    return steps


def test_a_long_prefill_ahead_of_a_decoder_never_starves_it() -> None:
    """Tenant a's decoder holds more than its share of the pool, so tenant b's long prompt comes
    first in the step's order (under its share); with the default budget (no decode_step_tokens)
    its chunks take what is left after a token for the decoder, every step, as vLLM v1 does."""
    layout = kv_layout(model_from_config(tiny_llama_config(), seed=0), BS)
    cache = TieredKVCache(layout, CacheConfig(block_size=BS, host_memory=0, disk_dir=None), num_pages=128)
    sched = Scheduler(cache, max_batch_tokens=32, newcomer_first=False)
    decoder = seq(300, 1, tenant="a")            # 76 pages of 128: over a's share once b arrives
    sched.add(decoder)
    _run(sched, lambda: decoder.output_ids)
    long = seq(150, 2, tenant="b")
    sched.add(long)
    steps = _run(sched, lambda: long.output_ids)
    assert len(steps) >= 150 // 32                    # the prompt went in chunks
    assert all(step.get("r1") == 1 for step in steps), f"the decoder missed steps: {steps}"
    assert all(sum(step.values()) <= 32 for step in steps)
    assert sum(step.get("r2", 0) for step in steps) == 150
    cache.close()


def test_steps_stay_within_the_budget_while_decoding_and_decodes_always_run() -> None:
    layout = kv_layout(model_from_config(tiny_llama_config(), seed=0), BS)
    cache = TieredKVCache(layout, CacheConfig(block_size=BS, host_memory=0, disk_dir=None), num_pages=128)
    sched = Scheduler(cache, max_batch_tokens=256, decode_step_tokens=8)
    decoder = seq(5, 1)
    sched.add(decoder)
    first = sched.schedule()
    assert [s.num_tokens for s in first] == [5]          # nobody decodes yet: the full budget
    sched.after_step(first)
    decoder.output_ids.append(0)
    late = [seq(40, 2), seq(25, 3)]
    for s in late:
        sched.add(s)
    steps = _run(sched, lambda: all(s.num_computed >= len(s.prompt_ids) for s in late))
    assert all(sum(step.values()) <= 8 for step in steps)
    assert all(step.get("r1") == 1 for step in steps), "the decoder got a token every step"
    assert len(steps) >= (40 + 25) // 7                   # the prefills were chunked to fit
    cache.close()


def test_greedy_outputs_are_the_same_with_the_budget(tmp_path) -> None:
    prompts = [random_prompt(n, seed=n) for n in (30, 9, 21)]
    greedy = SamplingParams(max_tokens=10)
    with make_engine(tmp_path / "a", disk=False) as eng:
        want = [o.token_ids for o in eng.generate(prompts, greedy)]
    with make_engine(tmp_path / "b", disk=False, decode_step_tokens=5) as eng:
        got = [o.token_ids for o in eng.generate(prompts, greedy)]
    assert got == want
