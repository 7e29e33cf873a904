"""Issue 42, item 2 on a GPU: a pool past 2^31 KV elements served by flex_paged, laid out by layer.

Page-major, such a pool put flex's 32-bit kernel offsets past their end (the H200 run of
2026-11-26: an illegal memory access at 8.7G elements), so it ran gather_sdpa. Layer-major
(storage/device_pool.py), each layer's view spans its own region: flex_paged and its CUDA-graphed
decode serve it, with transformers' greedy tokens cold and from every tier. And a small pool in
either layout gives the same tokens and the same block bytes (the Triton kernel visits the same
blocks whatever the view's length).
Run by tools/gpu_check.sh; `python -m pytest -m cuda tests/cuda/test_big_pool.py` runs them alone.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention_backends import FLEX_MAX_POOL_ELEMENTS
from storage.hashing import block_keys
from tests.cuda.test_cuda_path import cuda_engine, reference
from tests.engine.conftest import random_prompt
from tieredkv import SamplingParams

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(max_tokens=12)


def test_a_pool_past_2_31_elements_runs_flex_paged_and_graphs_on_every_tier(tmp_path, monkeypatch):
    monkeypatch.delenv("TIEREDKV_POOL_LAYOUT", raising=False)
    monkeypatch.delenv("TIEREDKV_ATTENTION", raising=False)
    prompts = [random_prompt(n, seed=300 + n) for n in (40, 300, 17)]
    want = [reference(None, ids, GREEDY.max_tokens) for ids in prompts]
    for eager in (False, True):
        # fp32, 2 layers: 9 GiB is 2.4G elements (one layer's region 1.2G).
        with cuda_engine(tmp_path / f"big{eager}", device_memory="9GiB", enforce_eager=eager) as eng:
            pool = eng.cache.pool
            assert pool.kv.numel() > FLEX_MAX_POOL_ELEMENTS and pool.by_layer
            status = eng.cache_status()["engine"]
            assert status["attention"] == "flex_paged"
            assert status["decode_step"] == ("off" if eager else "cuda_graph")
            compiles = eng.runner.backend.compiles
            assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want, "cold"
            for tier in ("device", "host", "disk"):
                if tier != "device":
                    eng.cache.demote("device")
                if tier == "disk":
                    eng.cache.demote("host")
                    eng.cache.disk.drain()
                outs = eng.generate(prompts, GREEDY)
                assert [o.token_ids for o in outs] == want, tier
                assert all(o.usage.hit_tokens_by_tier[tier] > 0 for o in outs), tier
            assert eng.runner.backend.compiles == compiles           # nothing past the sealed set
            eng.cache.audit()


@pytest.mark.parametrize("attention", ["gather_sdpa", "flex_paged"])
def test_both_layouts_give_the_same_tokens_and_block_bytes(tmp_path, monkeypatch, attention):
    prompts = [random_prompt(n, seed=400 + n) for n in (40, 100, 17)]
    want = [reference(None, ids, GREEDY.max_tokens) for ids in prompts]
    seen = {}
    for layout in ("page", "layer"):
        monkeypatch.setenv("TIEREDKV_POOL_LAYOUT", layout)
        with cuda_engine(tmp_path / layout, attention=attention) as eng:
            assert eng.cache.pool.by_layer == (layout == "layer")
            assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want, layout
            c = eng.cache
            keys = [k for ids in prompts for k in block_keys(eng.namespace("default"), ids, 16,
                                                             max_tokens=len(ids) - 1)]
            seen[layout] = [c.pool.kv[c.pool.page_of(k)].cpu().contiguous().view(torch.uint8) for k in keys]
            c.demote("device")
            c.transfer.sync_host()
            slab = [c.host.slab[c.host.slot_of(k)].view(torch.uint8) for k in keys]
            assert all(torch.equal(a, b) for a, b in zip(seen[layout], slab)), layout
    assert all(torch.equal(a, b) for a, b in zip(seen["page"], seen["layer"]))
