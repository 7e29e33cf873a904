"""The graph-safe decode step (issue 30 item 2), checked on the CPU.

torch.compile(fullgraph=True) over the very step CUDA captures as graphs: it compiles (any host
sync, .item(), tensor -> list or data-dependent branch would be a graph break, an error under
fullgraph), one graph per batch bucket and no more, and the engine's greedy tokens through it are
exactly the eager engine's and transformers' own -- with batches shrinking through every bucket as
requests finish, padding rows writing only their own page, and the blocks it wrote served again
from the cache. ($TIEREDKV_COMPILE_BACKEND=aot_eager: inductor's CPU compile is ~1 min a bucket
on a busy 2-core machine; tools/bench_throughput.py measures the inductor-compiled step.)
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.decode_graph import bucket_of, decode_buckets
from engine.engine import decode_mode
from tests.engine.conftest import make_engine, random_prompt, reference_greedy
from tieredkv import SamplingParams

import torch


def test_the_batch_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [bucket_of(n, decode_buckets(6)) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_the_mode_and_enforce_eager():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_mode("auto", False, cpu, "gather_sdpa") == "off"
    assert decode_mode("auto", False, cuda, "flex_paged") == "cuda_graph"
    assert decode_mode("auto", False, cuda, "gather_sdpa") == "off"
    assert decode_mode("auto", True, cuda, "flex_paged") == "off"
    assert decode_mode("compile", False, cpu, "gather_sdpa") == "compile"
    with pytest.raises(ValueError, match="contradicts enforce_eager"):
        decode_mode("cuda_graph", True, cuda, "flex_paged")
    with pytest.raises(ValueError, match="decode_step: expected"):
        decode_mode("graphs", False, cpu, "gather_sdpa")


@pytest.mark.parametrize("mode", ["static", "compile"])
def test_the_compiled_step_gives_the_eager_engines_greedy_tokens(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("TIEREDKV_COMPILE_BACKEND", "aot_eager")
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 37, 61, 100)]
    lengths = [3, 12, 7, 10, 5]       # requests finish at different steps: batches of 5, 4, 3, 2, 1
    want = [reference_greedy(None, ids, n) for ids, n in zip(prompts, lengths)]
    with make_engine(tmp_path, max_seqs=6, decode_step=mode) as eng:
        assert eng.cache_status()["engine"]["decode_step"] == mode
        decode = eng.runner.decode
        assert decode.buckets == [1, 2, 4, 6]
        if mode == "compile":
            assert decode.compiles == 4                 # every bucket at start, before any request
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p, n: eng.generate(p, SamplingParams(max_tokens=n)), prompts, lengths))
        assert [o.token_ids for o in outs] == want
        steps = decode.steps
        assert len(decode.runs) >= 2 and set(decode.runs) <= {1, 2, 4, 6}     # batches shrank through buckets
        # The blocks the step wrote are served from the cache and continue identically; nothing
        # the padding rows wrote reached a sequence's page.
        again = eng.generate(prompts, SamplingParams(max_tokens=12))
        assert [o.token_ids[:n] for o, n in zip(again, lengths)] == want
        assert all(o.usage.hit_tokens_by_tier["device"] > 0 for o in again if len(o.prompt_token_ids) > 4)
        assert decode.steps > steps
        if mode == "compile":
            assert decode.compiles == 4                 # no recompile past the buckets
        eng.cache.audit()
