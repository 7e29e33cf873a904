"""Issue 30 on a GPU: flex_paged's compiled shapes, the decode step's CUDA graphs, a 2 GiB pool;
issue 42: the decode step's graphs to the token ids (sampled rows drawn in the step).

What a user relies on: flex_paged compiles its known set at start and never again, whatever the
batch, query length or context (a recompile past the set would have run flex eagerly: scores
against the whole pool); decode steps replayed from CUDA graphs give exactly the eager engine's
greedy tokens (and transformers'), and seeded sampled rows drawn in the step's graphs exactly the
tokens the eager sampler draws from the same logits (no host sync in the step); a pool of >= 2 GiB
serves through flex_paged.
Run by tools/gpu_check.sh; `python -m pytest -m cuda` runs them alone.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.attention_backends import GatherSDPA
from engine.decode_graph import DecodeRow
from engine.model_runner import ModelRunner
from engine.model import model_from_config
from engine.paged_attention import ATTN_NAME, register
from engine.sampler import draw_knobs, is_greedy, make_generator, sample_batch
from engine.flex_paged import Q_TILE, FlexPaged
from tests.cuda.test_cuda_path import cuda_engine, reference
from tests.engine.conftest import random_prompt, tiny_llama_config
from tests.engine.test_decode_graph import DRAWS
from tests.engine.test_attention_backends import D, HEADS, KV_HEADS, L
from tests.engine.test_flex_buckets import PAGES, _random_pass, _run
from tieredkv import SamplingParams

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_paged_compiles_its_set_at_start_and_never_again(dtype, monkeypatch):
    """tests/engine/test_flex_buckets.py's sweep with inductor on the GPU, block size 16 (flex's
    kernel block): 24 passes of varied batch sizes, query lengths (1..300) and contexts."""
    import tests.engine.test_flex_buckets as fb
    monkeypatch.setattr(fb, "B", 16)
    kv = torch.randn((PAGES, L, 2, 16, KV_HEADS, D), generator=torch.Generator().manual_seed(0)).to("cuda", dtype)
    flex = FlexPaged(torch.device("cuda"))
    made = flex.warm_up(kv, 16, HEADS, dtype, max_query=2 * Q_TILE)
    assert made == flex.compiles and 3 <= made <= 4           # decode, short, (one tile,) several tiles
    rng = random.Random(0)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i in range(24):
        specs = _random_pass(rng, ("decode", "short", "tile", "tiles")[i % 4])
        want = _run(GatherSDPA(fused=False), kv, specs, seed=i)
        for a, b in zip(want, _run(flex, kv, specs, seed=i)):
            torch.testing.assert_close(b, a, **tol)
    assert flex.compiles == made                               # nothing past the set
    assert flex.classes_seen == {"decode", "short", "tile", "tiles"}


def _staggered(eng, prompts, lengths):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p, n: eng.generate(p, SamplingParams(max_tokens=n)).token_ids, prompts, lengths))


def test_decode_graphs_replay_the_eager_engines_greedy_tokens(tmp_path):
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 37, 61, 100, 130)]
    lengths = [4, 16, 9, 12, 6, 14]          # batches shrink through the buckets as requests finish
    want = [reference(None, ids, n) for ids, n in zip(prompts, lengths)]
    with cuda_engine(tmp_path / "eager", attention="flex_paged", enforce_eager=True, max_seqs=8) as eng:
        assert eng.runner.decode is None
        assert _staggered(eng, prompts, lengths) == want
    with cuda_engine(tmp_path / "graphs", attention="flex_paged", max_seqs=8, sync_debug="error") as eng:
        assert eng.cache_status()["engine"]["decode_step"] == "cuda_graph"
        decode = eng.runner.decode
        assert sorted(decode.graphs) == [1, 2, 4, 8]          # captured at start
        compiles = eng.runner.backend.compiles
        assert _staggered(eng, prompts, lengths) == want
        assert len(decode.runs) >= 2
        assert _staggered(eng, prompts, lengths) == want        # again, from the cache
        assert eng.runner.backend.compiles == compiles          # no recompile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graphed_step_draws_what_the_eager_sampler_draws(dtype):
    """The captured step and its draw's graph, greedy and sampled rows mixed and padding rows:
    the tokens are exactly sample_batch's over the step's own logits with the same seeds, step
    after step, with every host sync an error while they run."""
    register()
    loaded = model_from_config(tiny_llama_config(), seed=0, device="cuda", dtype=dtype, attn_implementation=ATTN_NAME)
    cfg, B = loaded.model.config, 16
    kv = torch.randn((12, cfg.num_hidden_layers, 2, B, cfg.num_key_value_heads,
                      cfg.hidden_size // cfg.num_attention_heads), device="cuda", dtype=dtype)
    # flex_paged warmed up and the step captured as the engine builds them
    step = ModelRunner(loaded.model, kv, B, "flex_paged", max_query=1, decode="cuda_graph", max_seqs=8,
                       max_context=32, sink=11).decode
    assert sorted(step.graphs) == sorted(step.tails) == [1, 2, 4, 8]
    ours = [make_generator(p, "cuda") for p in DRAWS]
    theirs = [make_generator(p, "cuda") for p in DRAWS]
    for t in range(4):
        rows = [DecodeRow(7 + i + t, 3 + 4 * i + t, (i,), None if is_greedy(p) else (draw_knobs(p, step.vocab), g))
                for i, (p, g) in enumerate(zip(DRAWS, ours))]
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = step.run(rows)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert step.tokens.tolist() == [r.token for r in sample_batch(logits, DRAWS, theirs).read()], t


def test_sampled_requests_through_graphs_draw_the_eager_engines_tokens(tmp_path):
    prompts = [random_prompt(n, seed=300 + n) for n in (5, 37, 61, 100, 17, 23)]
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                             min_p=d.min_p, seed=d.seed) for i, d in enumerate(DRAWS)]
    outs = []
    for kw in ({"enforce_eager": True}, {"sync_debug": "error"}):
        with cuda_engine(tmp_path / str(len(outs)), attention="flex_paged", max_seqs=8, **kw) as eng:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs.append([o.token_ids for o in pool.map(eng.generate, prompts, params)])
            assert eng.runner.decode is None or eng.runner.decode.drawn_steps > 0
    assert outs[0] == outs[1]


def test_a_2gib_pool_through_flex_paged(tmp_path):
    """Eager flex would score every query against the whole pool view (~33M rows here): out of
    memory. The compiled set serves it, graphs on and off."""
    prompts = [random_prompt(n, seed=200 + n) for n in (40, 300, 17)]
    want = [reference(None, ids, 12) for ids in prompts]
    for eager in (True, False):
        with cuda_engine(tmp_path / f"big{eager}", attention="flex_paged", device_memory="2GiB",
                         enforce_eager=eager) as eng:
            assert eng.cache.pool.kv.numel() * eng.cache.pool.kv.element_size() >= 2 << 30
            compiles = eng.runner.backend.compiles
            assert [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=12))] == want
            assert eng.runner.backend.compiles == compiles
