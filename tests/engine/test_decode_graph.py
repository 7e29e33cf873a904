"""The graph-safe decode step (issue 30 item 2), checked on the CPU.

torch.compile(fullgraph=True) over the very step CUDA captures as graphs (embedding to sampled
token ids: the draw of every sampled row is in the step, each seeded row drawing exactly what the
eager sampler draws for it): it compiles (any host
sync, .item(), tensor -> list or data-dependent branch would be a graph break, an error under
fullgraph), one graph per batch bucket and no more, and the engine's greedy tokens through it are
exactly the eager engine's and transformers' own -- with batches shrinking through every bucket as
requests finish, padding rows writing only their own page, and the blocks it wrote served again
from the cache. ($TIEREDKV_COMPILE_BACKEND=aot_eager: inductor's CPU compile is ~1 min a bucket
on a busy 2-core machine; tools/bench_throughput.py measures the inductor-compiled step.)
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.decode_graph import DecodeGraphs, DecodeRow, bucket_of, decode_buckets
from engine.engine import decode_mode
from engine.model import model_from_config
from engine.paged_attention import ATTN_NAME, register
from engine.attention_backends import GATHER_SDPA
from engine.sampler import draw_knobs, is_greedy, make_generator, sample_batch
from tests.engine.conftest import make_engine, random_prompt, reference_greedy, tiny_llama_config
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
            assert decode.compiles == 8                 # every bucket's step and draw at start, before any request
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
            assert decode.compiles == 8                 # no recompile past the buckets
        eng.cache.audit()


# Every stage of a draw in one step: greedy, temperature alone, top-k, top-p, min-p, all at once.
DRAWS = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
         SamplingParams(temperature=0.7, top_p=0.6, seed=3), SamplingParams(temperature=1.0, min_p=0.2, seed=4),
         SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, seed=5)]


def test_the_whole_step_compiled_fullgraph_chooses_the_eager_steps_tokens(monkeypatch):
    """The decode step from the embedding to the token ids, greedy and drawn rows mixed and a
    padding row, compiled once with fullgraph (a graph break is an error): the same tokens as the
    step run eagerly, which are exactly what the eager sampler draws from its logits with the same
    seeds, step after step (the generators' streams stay in step)."""
    register()
    loaded = model_from_config(tiny_llama_config(), seed=0, attn_implementation=ATTN_NAME)
    cfg, B = loaded.model.config, 4
    kv = torch.randn((48, cfg.num_hidden_layers, 2, B, cfg.num_key_value_heads,
                      cfg.hidden_size // cfg.num_attention_heads), generator=torch.Generator().manual_seed(0))
    step = DecodeGraphs(loaded.model, kv, B, GATHER_SDPA, max_seqs=8, max_context=32, sink=47, mode="static")
    compiled = torch.compile(step.whole, backend="aot_eager", fullgraph=True, dynamic=False)
    ours = [make_generator(p) for p in DRAWS]
    theirs = [make_generator(p) for p in DRAWS]
    pages = [tuple(range(7 * i, 7 * i + 7)) for i in range(len(DRAWS))]
    with torch.inference_mode():
        for t in range(3):
            rows = [DecodeRow(7 + i + t, 9 + 3 * i + t, pages[i],
                              None if is_greedy(p) else (draw_knobs(p, step.vocab), g))
                    for i, (p, g) in enumerate(zip(DRAWS, ours))]
            logits = step.run(rows)                         # eager; bucket 8: two padding rows
            eager = step.tokens.tolist()
            want = [r.token for r in sample_batch(logits, DRAWS, theirs).read()]
            assert eager == want, t
            tokens, nan = compiled(8)                       # the same buffers and noise, compiled
            assert tokens[:len(DRAWS)].tolist() == eager and not nan.any()
            assert step.drawn_steps == t + 1


def test_sampled_requests_get_the_eager_samplers_tokens_through_the_decode_step(tmp_path):
    """Through the engine: seeded requests of every kind draw the same tokens and logprobs with
    their draws in the decode step as with the eager sampler (decode_step off), and a step with a
    row the step cannot draw (penalties, min_tokens, a first token with choices to fork) is
    sampled from its logits as before, the others' streams unchanged."""
    prompts = [random_prompt(n, seed=40 + n) for n in (6, 17, 30, 45, 11, 23, 9, 14)]
    params = [SamplingParams(max_tokens=6 + i, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                             min_p=d.min_p, seed=d.seed, logprobs=3 if i == 3 else 0) for i, d in enumerate(DRAWS)]
    params += [SamplingParams(max_tokens=3, temperature=0.8, presence_penalty=0.5, seed=7),
               SamplingParams(max_tokens=4, temperature=0.8, min_tokens=3, seed=8)]
    outs = {}
    for mode in ("off", "static"):
        with make_engine(tmp_path / mode, max_seqs=8, decode_step=mode) as eng:
            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(eng.generate, prompts, params))
            forked = eng.generate(prompts[0], SamplingParams(max_tokens=5, temperature=0.9, seed=11, n=2))
            outs[mode] = ([o.token_ids for o in got], [c.token_ids for c in forked],
                          [(o.logprobs, o.token_logprobs) for o in got if o.logprobs])
            if mode == "static":
                assert eng.runner.decode.drawn_steps > 0       # tokens were drawn in the step
    assert outs["static"][:2] == outs["off"][:2]
    # The logprobs are the model's: the same ids, values within float rounding (the decode step's
    # attention sums its padded context in another order than the eager pass: last bits differ).
    [(top, chosen)], [(top_off, chosen_off)] = outs["static"][2], outs["off"][2]
    assert [[t for t, _ in row] for row in top] == [[t for t, _ in row] for row in top_off]
    assert chosen == pytest.approx(chosen_off, abs=1e-5)
