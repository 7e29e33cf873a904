"""Greedy outputs and logits of the paged engine against plain transformers and full recompute."""
import pytest
import torch

from tests.engine.conftest import (make_engine, random_prompt, reference_greedy, tiny_llama_config,
                                   tiny_qwen2_config)
from tieredkv import SamplingParams

GREEDY = SamplingParams(max_tokens=12)


@pytest.mark.parametrize("length", [3, 4, 8, 13, 16, 37])   # < block, multiples of 4, odd
def test_greedy_equals_transformers_generate(tmp_path, length):
    ids = random_prompt(length, seed=length)
    with make_engine(tmp_path) as eng:
        out = eng.generate(ids, GREEDY)
        assert out.token_ids == reference_greedy(None, ids, 12)
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        again = eng.generate(ids, GREEDY)     # now from the cache: an exact hit, every token
        assert again.token_ids == out.token_ids
        assert again.usage.prompt_cache_hit_tokens == length
        other = ids[:-1] + [(ids[-1] + 1) % 128]    # another last token: a prefix hit, capped at len - 1
        assert eng.generate(other, GREEDY).usage.prompt_cache_hit_tokens == ((length - 1) // 4) * 4


def test_qwen2_architecture_also_matches(tmp_path):
    ids = random_prompt(19, seed=5)
    with make_engine(tmp_path, tiny_qwen2_config()) as eng:
        assert eng.generate(ids, GREEDY).token_ids == reference_greedy(tiny_qwen2_config(), ids, 12)


def test_chunked_prefill_equals_one_pass(tmp_path):
    ids = random_prompt(70, seed=2)
    with make_engine(tmp_path, max_batch_tokens=16) as eng:     # 70 tokens in 5 chunks
        assert eng.generate(ids, GREEDY).token_ids == reference_greedy(None, ids, 12)


def _top_logprobs(eng, ids):
    out = eng.generate(ids, SamplingParams(max_tokens=1, logprobs=20))
    return out, torch.tensor([lp for _, lp in out.logprobs[0]]), [t for t, _ in out.logprobs[0]]


def test_logits_after_hits_from_each_tier_equal_recompute(tmp_path):
    """Block 0-1 from device, 2-3 from host, 4-5 from disk; each arrangement against recompute."""
    B = 4
    ids = random_prompt(6 * B + 3, seed=11)
    with make_engine(tmp_path / "ref", disk=False) as ref_eng:
        ref_eng.cache.drop("device")
        _, ref_lp, ref_tok = _top_logprobs(ref_eng, ids)
    # Every hit restored from its tier, the last tokens computed from it (no exact entries).
    with make_engine(tmp_path, restore_policy="load", exact_hits=False) as eng:
        cache = eng.cache
        first, lp, tok = _top_logprobs(eng, ids)
        assert first.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 0, "remote": 0}
        assert tok == ref_tok and torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)

        def check(expected_tiers):
            out, lp, tok = _top_logprobs(eng, ids)
            assert out.usage.hit_tokens_by_tier == expected_tiers
            assert out.usage.prompt_cache_miss_tokens == len(ids) - sum(expected_tiers.values())
            assert tok == ref_tok
            assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)

        check({"device": 24, "host": 0, "disk": 0, "remote": 0})
        cache.demote("device")
        check({"device": 0, "host": 24, "disk": 0, "remote": 0})
        cache.demote("device")
        cache.demote("host")
        cache.disk.drain()
        check({"device": 0, "host": 0, "disk": 24, "remote": 0})
        # Mixed: disk everything; promote 0-3 then push them to host; promote 0-1 to device.
        cache.demote("device")
        cache.demote("host")
        cache.disk.drain()
        eng.generate(ids[:4 * B + 1], SamplingParams(max_tokens=1))
        cache.demote("device")
        eng.generate(ids[:2 * B + 1], SamplingParams(max_tokens=1))
        check({"device": 8, "host": 8, "disk": 8, "remote": 0})
        cache.audit()


def test_batch_of_different_lengths_equals_one_by_one(tmp_path):
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 9, 33, 2, 24)]
    with make_engine(tmp_path, disk=False) as eng:
        singles = [eng.generate(p, GREEDY).token_ids for p in prompts]
    with make_engine(tmp_path, disk=False) as eng:
        batch = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in batch] == singles
    assert singles[3] == reference_greedy(None, prompts[3], 12)


def test_preemption_does_not_change_outputs(tmp_path):
    prompts = [random_prompt(30, seed=100 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24)
    with make_engine(tmp_path, disk=False, device_memory="256KiB") as eng:
        expected = [eng.generate(p, params).token_ids for p in prompts]
    # 24 pages of 4 tokens: six sequences of up to 54 tokens cannot all fit -> preemption.
    with make_engine(tmp_path, disk=False, device_memory=24 * 2048, host_memory=0) as eng:
        outs = eng.generate(prompts, params)
        assert eng.scheduler.preemptions > 0
        assert [o.token_ids for o in outs] == expected
        for o in outs:   # preemption recompute is not billed twice
            assert o.usage.prompt_cache_hit_tokens + o.usage.prompt_cache_miss_tokens == 30
        eng.cache.audit()


def test_in_batch_dedup_computes_shared_prefix_once(tmp_path):
    shared = random_prompt(32, seed=7)
    prompts = [shared + random_prompt(5, seed=50 + i) for i in range(4)]
    with make_engine(tmp_path, disk=False) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=2))
        misses = sorted(o.usage.prompt_cache_miss_tokens for o in outs)
        # One request computes the 32 shared tokens; the others hit all 8 shared blocks.
        assert misses == [5, 5, 5, 37]
        assert sorted(o.usage.hit_tokens_by_tier["device"] for o in outs) == [0, 32, 32, 32]


def test_generated_blocks_are_cached_for_the_next_turn(tmp_path):
    ids = random_prompt(6, seed=3)
    with make_engine(tmp_path, disk=False) as eng:
        out = eng.generate(ids, SamplingParams(max_tokens=14))
        turn2 = ids + out.token_ids + random_prompt(3, seed=4)
        out2 = eng.generate(turn2, SamplingParams(max_tokens=2))
        # 6 + 14 = 20 tokens: the first 19 have KV (the last sampled token was never fed back),
        # so 4 full blocks (16 tokens) including generated ones are hits.
        assert out2.usage.hit_tokens_by_tier["device"] == 16


def test_usage_invariant_and_tenant_isolation(tmp_path):
    ids = random_prompt(25, seed=9)
    with make_engine(tmp_path) as eng:
        a1 = eng.generate(ids, GREEDY, tenant="alice")
        a2 = eng.generate(ids, GREEDY, tenant="alice")
        b1 = eng.generate(ids, GREEDY, tenant="bob")
        for o in (a1, a2, b1):
            assert o.usage.prompt_cache_hit_tokens + o.usage.prompt_cache_miss_tokens == o.usage.prompt_tokens == 25
        assert a2.usage.prompt_cache_hit_tokens == 25      # an exact repeat
        assert b1.usage.prompt_cache_hit_tokens == 0          # isolation: bob never hits alice's blocks
        assert a1.token_ids == a2.token_ids == b1.token_ids
        assert eng.lookup(ids, tenant="alice").hit_tokens == 25
        assert eng.lookup(ids[:-1] + [(ids[-1] + 1) % 128], tenant="alice").hit_tokens == 24
        assert eng.lookup(ids, tenant="carol").hit_tokens == 0


def test_shared_cache_across_tenants_when_isolation_is_off(tmp_path):
    ids = random_prompt(25, seed=9)
    with make_engine(tmp_path, isolate_tenants=False) as eng:
        eng.generate(ids, GREEDY, tenant="alice")
        assert eng.generate(ids, GREEDY, tenant="bob").usage.prompt_cache_hit_tokens == 25   # an exact hit


def test_stream_chunks_concatenate_to_generate(tmp_path):
    ids = random_prompt(10, seed=1)
    with make_engine(tmp_path) as eng:
        full = eng.generate(ids, GREEDY)
        chunks = list(eng.stream(ids, GREEDY))
        assert sum((c.token_ids for c in chunks), []) == full.token_ids
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.prompt_tokens == 10
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_lookup_promotes_and_bills_nothing(tmp_path):
    ids = random_prompt(25, seed=9)
    with make_engine(tmp_path) as eng:
        eng.generate(ids, GREEDY)
        eng.cache.demote("device")
        before = eng.cache_status()["tiers"]
        assert eng.lookup(ids).hit_tokens_by_tier == {"device": 0, "host": 25, "disk": 0, "remote": 0}   # exact
        after = eng.cache_status()["tiers"]
        assert before == after
        assert eng.ledger.tenant("default").requests == 1


def test_sampling_is_reproducible_with_seed(tmp_path):
    ids = random_prompt(10, seed=1)
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    with make_engine(tmp_path) as eng:
        assert eng.generate(ids, p).token_ids == eng.generate(ids, p).token_ids


def test_engine_model_outside_the_engine_matches_sdpa_with_a_dynamic_cache(tmp_path):
    """The engine's model object, run by plain transformers code with a KV cache and several new
    tokens at once, must still attend over the cached prefix (the SDPA fallback needs a mask)."""
    from transformers import DynamicCache
    ids = torch.tensor([random_prompt(20, seed=21)])
    with make_engine(tmp_path, disk=False) as eng:
        model = eng.loaded.model
        with torch.no_grad():
            full = model(ids).logits
            cache = DynamicCache(config=model.config)
            model(ids[:, :12], past_key_values=cache, use_cache=True)
            tail = model(ids[:, 12:], past_key_values=cache, use_cache=True).logits
    assert torch.allclose(tail, full[:, 12:], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_through_every_tier_is_exact_in_half_precision(tmp_path, dtype):
    """The CPU runs bf16 by default where it is native (engine/model.py): a hit from the device,
    the host or the disk gives exactly the tokens the same engine computes without a cache (an
    exact hit: its first token from the stored logits, no forward)."""
    from engine.model import model_from_config
    from tieredkv import CacheConfig, Engine
    loaded = model_from_config(tiny_llama_config(), seed=0, dtype=dtype)
    cfg = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=str(tmp_path / "kv"),
                      disk_capacity="64MiB", restore_policy="load")
    with Engine(loaded, cfg) as eng:
        assert eng.layout.dtype == dtype
        for seed in range(6):
            ids = random_prompt(29 + 3 * seed, seed=200 + seed)
            computed = eng.generate(ids, GREEDY)
            assert computed.usage.prompt_cache_hit_tokens == 0
            device = eng.generate(ids, GREEDY)
            eng.cache.demote("device")
            host = eng.generate(ids, GREEDY)
            eng.cache.demote("device")
            eng.cache.demote("host")
            assert eng.cache.disk.drain()
            disk = eng.generate(ids, GREEDY)
            full = len(ids)       # an exact hit: every token, the tail and the logits from the tier
            assert device.usage.hit_tokens_by_tier["device"] == host.usage.hit_tokens_by_tier["host"] == full
            assert disk.usage.hit_tokens_by_tier["disk"] == full
            assert computed.token_ids == device.token_ids == host.token_ids == disk.token_ids
