"""Issue 29: an exact repeat computes nothing, and n choices cost one prefill.

Real tiny engines (random weights), real pool, host slab, LMDB disk tier. The claims a user
relies on: the same tokens with and without the exact hit, on every tier; zero forward tokens
for the prompt; the stored logits bit-identical after every round trip; a damaged entry a miss;
billing exact; n greedy choices equal one greedy run; seeded choices reproducible and distinct;
a choice's writes invisible to its siblings; every page back after the choices end.
"""
from __future__ import annotations

import pytest
import torch

from engine.model import model_from_config
from storage.exact_entry import read_logits
from tests.engine.conftest import make_engine, random_prompt, tiny_llama_config
from tieredkv import CacheConfig, Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=8)


def _logits_of(eng, ids, tenant="default"):
    """The exact entry's stored logits for `ids` as the pool holds them now (it must be there)."""
    chain = _chain(eng, ids, tenant)
    seq_keys = eng.cache.match(chain)
    assert len(seq_keys) == len(chain) and all(t == "device" for _, t in seq_keys.blocks)
    pages = [eng.cache.pool.page_of(k) for k in chain[-eng.logits_format.pages:]]
    return read_logits(eng.cache.pool.kv, pages, eng.logits_format).clone()


def _chain(eng, ids, tenant="default"):
    from storage.exact_entry import exact_keys
    from storage.hashing import block_keys, root_hash
    ns = eng.namespace(tenant)
    return exact_keys(block_keys(ns, ids, eng.block_size), ids, ns, eng.block_size, root_hash(ns),
                      eng.logits_format).chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [13, 16])        # a partial tail page; a prompt filling its last block
def test_exact_repeat_equals_cold_from_every_tier_with_no_forward(tmp_path, dtype, length):
    loaded = model_from_config(tiny_llama_config(), seed=0, dtype=dtype)
    cfg = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=str(tmp_path / "kv"),
                      disk_capacity="64MiB")
    with Engine(loaded, cfg) as eng:
        ids = random_prompt(length, seed=40 + length)
        cold = eng.generate(ids, GREEDY)
        assert cold.usage.prompt_cache_miss_tokens == length
        stored = _logits_of(eng, ids)
        for tier in ("device", "host", "disk"):
            if tier in ("host", "disk"):
                eng.cache.demote("device")
            if tier == "disk":
                eng.cache.demote("host")
                assert eng.cache.disk.drain()
            computed, hits = eng.runner.tokens_computed, eng.scheduler.exact_hits
            out = eng.generate(ids, GREEDY)
            assert out.token_ids == cold.token_ids
            # Nothing of the prompt was computed: only the 7 decode steps after the first token.
            assert eng.runner.tokens_computed - computed == GREEDY.max_tokens - 1
            assert eng.scheduler.exact_hits - hits == 1
            assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 0, "remote": 0, tier: length}
            assert out.usage.prompt_cache_miss_tokens == 0
            # The logits came back through the tier bit for bit (they are on the device again).
            assert torch.equal(_logits_of(eng, ids).view(torch.uint8), stored.view(torch.uint8))
        eng.cache.audit()


def test_another_last_token_is_a_prefix_hit_and_sampling_settings_apply_after(tmp_path):
    ids = random_prompt(14, seed=3)
    with make_engine(tmp_path) as eng:
        eng.generate(ids, GREEDY)
        other = eng.generate(ids[:-1] + [(ids[-1] + 1) % 128], GREEDY)
        assert other.usage.prompt_cache_hit_tokens == 12 and other.usage.prompt_cache_miss_tokens == 2
        # The entry holds raw logits: a sampled request with penalties on an exact hit draws the
        # same tokens as the same request computed cold (same seed) on a fresh engine.
        sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=11, repetition_penalty=1.3, top_k=20)
        hit = eng.generate(ids, sampled)
        assert hit.usage.prompt_cache_miss_tokens == 0
    with make_engine(tmp_path / "fresh", exact_hits=False) as fresh:
        assert fresh.generate(ids, sampled).token_ids == hit.token_ids


def test_a_damaged_logits_block_on_disk_is_a_miss_and_the_prompt_is_computed(tmp_path):
    ids = random_prompt(13, seed=8)
    with make_engine(tmp_path) as eng:
        cold = eng.generate(ids, GREEDY)
        eng.cache.demote("device")
        eng.cache.demote("host")
        assert eng.cache.disk.drain()
        logits_key = _chain(eng, ids)[-1]
        disk = eng.cache.disk
        with disk._gate.begin(write=True) as txn:       # flip a byte inside the stored payload
            raw = bytearray(txn.get(logits_key.hash, db=disk._payload))
            raw[-5] ^= 0x40
            assert txn.put(logits_key.hash, bytes(raw), db=disk._payload)
        hits = eng.scheduler.exact_hits
        out = eng.generate(ids, GREEDY)
        assert out.token_ids == cold.token_ids
        assert eng.scheduler.exact_hits == hits             # not an exact hit
        assert out.usage.prompt_cache_miss_tokens == 1      # 12 tokens of full blocks hit, the tail computed
        assert not disk.contains(logits_key)                # the damaged block was deleted


def test_exact_hits_are_per_tenant(tmp_path):
    with make_engine(tmp_path) as eng:
        ids = random_prompt(9, seed=5)
        eng.generate(ids, GREEDY, tenant="alice")
        # Keyed by token ids and the tenant's namespace: bob (isolated) computes, alice hits.
        assert eng.generate(ids, GREEDY, tenant="bob").usage.prompt_cache_miss_tokens == 9
        assert eng.generate(list(ids), GREEDY, tenant="alice").usage.prompt_cache_miss_tokens == 0


def test_n_greedy_choices_equal_one_greedy_run_and_cost_one_prefill(tmp_path):
    ids = random_prompt(30, seed=12)
    with make_engine(tmp_path) as eng:
        one = eng.generate(ids, GREEDY)
    with make_engine(tmp_path / "b") as eng:
        free = eng.cache.pool.num_free
        computed = eng.runner.tokens_computed
        outs = eng.generate(ids, SamplingParams(max_tokens=8, n=4))
        assert [o.index for o in outs] == [0, 1, 2, 3]
        assert all(o.token_ids == one.token_ids for o in outs)
        # One prefill: 30 prompt tokens, then 4 choices x 7 decode steps.
        assert eng.runner.tokens_computed - computed == 30 + 4 * 7
        u = outs[0].usage
        assert all(o.usage == u for o in outs)
        assert (u.prompt_tokens, u.completion_tokens, u.prompt_cache_miss_tokens) == (30, 32, 30)
        # Every page the choices held is back (cached blocks stay findable, as evictable pages).
        assert eng.cache.pool.num_free == free and eng.cache.pool.stats().in_use_pages == 0
        eng.cache.audit()


def test_seeded_choices_are_reproducible_and_distinct(tmp_path):
    ids = random_prompt(10, seed=13)
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=4, logprobs=2)
    with make_engine(tmp_path) as eng:
        a = eng.generate(ids, p)
        b = eng.generate(ids, p)        # an exact hit this time: the same draws
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert len({tuple(o.token_ids) for o in a}) == 4
        assert all(len(o.token_logprobs) == len(o.token_ids) == 10 for o in a)
        # Choice 0 is the n=1 request with the same seed.
        assert eng.generate(ids, SamplingParams(max_tokens=10, temperature=1.0, seed=1234)).token_ids == a[0].token_ids


def test_a_choice_writes_never_reach_its_siblings(tmp_path):
    """Choices diverge inside the prompt's partial last page (13 tokens: 1 in page 3): each copies
    it before writing, so every choice equals the same seeded request run alone with its seed."""
    from engine.sampler import choice_seed
    ids = random_prompt(13, seed=14)
    p = SamplingParams(max_tokens=12, temperature=1.5, seed=77, n=3)
    with make_engine(tmp_path, exact_hits=False) as eng:
        outs = eng.generate(ids, p)
        copies = eng.scheduler.cow_copies
        assert copies >= 2            # the shared partial page, copied by all but its last holder
    for i, out in enumerate(outs):
        with make_engine(tmp_path / f"alone{i}", exact_hits=False) as alone:
            solo = SamplingParams(max_tokens=12, temperature=1.5, seed=choice_seed(77, i))
            assert alone.generate(ids, solo).token_ids == out.token_ids


def test_streamed_choices_carry_their_index_and_the_request_is_billed_once(tmp_path):
    ids = random_prompt(11, seed=15)
    with make_engine(tmp_path, ledger_dir=str(tmp_path / "billing")) as eng:
        chunks = list(eng.stream(ids, SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=3)))
        by_index = {i: [c for c in chunks if c.index == i] for i in range(3)}
        assert all(sum(len(c.token_ids) for c in cs) == 5 for cs in by_index.values())
        finals = [c for c in chunks if c.finish_reason is not None]
        assert sorted(c.index for c in finals) == [0, 1, 2]
        assert finals[0].usage.completion_tokens == 15 and finals[0].usage.prompt_tokens == 11
        # generate/stream answer only once the bill is committed: the ledger holds it now.
        entry = eng.ledger.tenant("default")
        assert (entry.requests, entry.prompt_tokens, entry.completion_tokens) == (1, 11, 15)


def test_n_above_max_n_is_refused(tmp_path):
    with make_engine(tmp_path, max_n=4) as eng:
        with pytest.raises(ValueError, match="n: at most 4"):
            eng.generate([1, 2, 3], SamplingParams(n=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [13, 16])
def test_an_exact_repeat_from_the_remote_store_computes_nothing(tmp_path, valkey, length, dtype):
    """Server A computes a prompt and closes (its blocks, tail and logits go to the shared store);
    server B, with a disk of its own, repeats it: an exact hit from the remote tier, zero prompt
    tokens computed, the same greedy tokens as A's cold run, billed as remote hits."""
    tenant = f"exact-remote-{length}-{dtype}".replace("torch.", "")   # the session's store is shared: a namespace of its own
    ids = random_prompt(length, seed=90 + length)

    def server(name):
        cfg = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB",
                          disk_dir=str(tmp_path / name / "kv"), disk_capacity="64MiB", remote_url=valkey.url,
                          remote_write="write_through")
        return Engine(model_from_config(tiny_llama_config(), seed=0, dtype=dtype), cfg)
    with server("a") as a:
        cold = a.generate(ids, GREEDY, tenant=tenant)
        assert cold.usage.prompt_cache_miss_tokens == length
        stored = _logits_of(a, ids, tenant)
        assert a.cache.flush().complete and a.cache.remote.drain(30)
    with server("b") as b:
        assert b.lookup(ids, tenant=tenant).hit_tokens_by_tier["remote"] == length
        computed, hits = b.runner.tokens_computed, b.scheduler.exact_hits
        out = b.generate(ids, GREEDY, tenant=tenant)
        assert out.token_ids == cold.token_ids
        assert b.scheduler.exact_hits - hits == 1
        assert b.runner.tokens_computed - computed == GREEDY.max_tokens - 1      # decode steps only
        assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 0, "remote": length}
        assert out.usage.prompt_cache_miss_tokens == 0
        # The logits came through the store bit for bit (B holds them on its device now).
        assert torch.equal(_logits_of(b, ids, tenant).view(torch.uint8), stored.view(torch.uint8))
        b.cache.audit()


@pytest.mark.parametrize("length", [13, 16])
def test_cache_status_counts_an_exact_hits_prompt_tokens_not_its_blocks(tmp_path, length):
    """cache_status' per-tier hit_tokens agree with the bills: an exact hit's tail block holds
    fewer tokens than a block and its logits blocks none (they were counted as whole blocks)."""
    loaded = model_from_config(tiny_llama_config(), seed=0)
    cfg = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=str(tmp_path / "kv"),
                      disk_capacity="64MiB")
    with Engine(loaded, cfg) as eng:
        ids = random_prompt(length, seed=70 + length)
        eng.generate(ids, GREEDY)
        for tier in ("device", "host"):
            if tier == "host":
                eng.cache.demote("device")
            before = eng.cache_status()["tiers"][tier]["hit_tokens"]
            hits = eng.scheduler.exact_hits
            out = eng.generate(ids, GREEDY)
            assert eng.scheduler.exact_hits == hits + 1
            assert out.usage.hit_tokens_by_tier[tier] == length
            assert eng.cache_status()["tiers"][tier]["hit_tokens"] - before == length
