"""flex_paged's compiled shapes: a bounded, known set, compiled at start and never exceeded.

torch.compile of the same flex path (dynamo, backend aot_eager) runs on the CPU: the buckets, the
warm-up's compiles and the recompile count over passes of varied batch sizes, query lengths and
context lengths are asserted here; tests/cuda asserts them again with inductor on a GPU. Every
compiled pass also gives gather_sdpa's outputs.
"""
import random

import pytest
import torch

from engine.attention_backends import GatherSDPA
from engine.flex_paged import (Q_TILE, FlexPaged, FlexRecompileError, bucket_batch, bucket_query, bucket_width,
                               shape_class)
from engine.paged_batch import PagedBatch, SeqSlice
from tests.engine.test_attention_backends import B, D, HEADS, KV_HEADS, L, _outputs

CPU = torch.device("cpu")
PAGES = 120


def test_the_buckets():
    assert [bucket_batch(s) for s in (1, 2, 3, 4, 5, 9, 64)] == [2, 2, 4, 4, 8, 16, 64]
    assert [bucket_query(q) for q in (1, 2, 16, 17, 33, 64, 65, 128, 129, 300)] == \
        [1, 16, 16, 32, 64, 64, 128, 128, 256, 384]
    assert [bucket_width(n) for n in (1, 2, 3, 5, 512, 513)] == [2, 2, 4, 8, 512, 1024]
    assert [shape_class(bucket_query(q)) for q in (1, 2, 64, 65, 128, 129, 1000)] == \
        ["decode", "short", "short", "tile", "tile", "tiles", "tiles"]


def _pool(seed: int = 0, by_layer: bool = False) -> torch.Tensor:
    """Built outside inference mode, as the engine's pool is; `by_layer`: the same view over
    layer-major memory (storage/device_pool.py)."""
    kv = torch.randn((PAGES, L, 2, B, KV_HEADS, D), generator=torch.Generator().manual_seed(seed))
    return kv.transpose(0, 1).contiguous().transpose(0, 1) if by_layer else kv


def _random_pass(rng: random.Random, kind: str) -> list[tuple[int, int, tuple[int, ...]]]:
    pages = list(range(PAGES))
    rng.shuffle(pages)
    specs = []
    for _ in range(rng.randint(1, 6)):
        q = {"decode": 1, "short": rng.randint(2, 64), "tile": rng.randint(65, 128),
             "tiles": rng.randint(129, 300)}[kind]
        ctx = rng.randint(1, 200) if q == 1 else rng.randint(q, q + 60)
        n = -(-ctx // B)
        if len(pages) < n:
            break
        specs.append((q, ctx, tuple(pages[:n])))
        pages = pages[n:]
    return specs


def _run(backend, kv, specs, seed):
    with torch.inference_mode():     # as ModelRunner.forward runs
        gen = torch.Generator().manual_seed(seed)
        seqs, at = [], 0
        for q_len, ctx, pages in specs:
            seqs.append(SeqSlice(at, q_len, ctx, pages))
            at += q_len
        q_all = torch.randn((at, HEADS, D), generator=gen).to(kv.device, kv.dtype)
        batch = PagedBatch(kv, seqs, B, backend)
        return _outputs(batch, kv, q_all)


@pytest.mark.parametrize("by_layer", [False, True], ids=["page_major", "layer_major"])
def test_warm_up_compiles_the_set_and_varied_passes_never_recompile(by_layer):
    flex = FlexPaged(CPU, compile="aot_eager")
    kv = _pool(by_layer=by_layer)
    made = flex.warm_up(kv, B, HEADS, torch.float32, max_query=2 * Q_TILE)
    # decode, short, one tile, several tiles: on the CPU's aot_eager a short chunk and a full tile
    # share a graph (inductor's decode-kernel choice splits them on CUDA).
    assert made == flex.compiles == 3
    rng = random.Random(0)
    for i in range(24):
        kind = ("decode", "short", "tile", "tiles")[i % 4]
        specs = _random_pass(rng, kind)
        want = _run(GatherSDPA(fused=False), kv, specs, seed=i)
        got = _run(flex, kv, specs, seed=i)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert flex.compiles == 3                      # nothing past the set
    assert flex.classes_seen == {"decode", "short", "tile", "tiles"}


def test_a_shape_past_the_sealed_set_fails_loudly_instead_of_running_eagerly():
    flex = FlexPaged(CPU, compile="aot_eager")
    kv = _pool()
    assert flex.warm_up(kv, B, HEADS, torch.float32, max_query=1) == 1      # decodes only
    _run(flex, kv, [(1, 9, (0, 1, 2)), (1, 5, (3, 4))], seed=0)              # a decode: compiled
    with pytest.raises(Exception) as err:
        _run(flex, kv, [(3, 3, (10,)), (2, 10, (11, 12, 13))], seed=1)       # a prefill chunk: not
    assert isinstance(err.value, FlexRecompileError) or isinstance(err.value.__cause__, FlexRecompileError) \
        or "FlexRecompileError" in str(err.value)
    assert flex.compiles == 1
    assert torch._dynamo.config.fail_on_recompile_limit_hit     # and the limit never means eager


def test_each_instance_counts_its_own_compiles():
    kv = _pool()
    a, b = FlexPaged(CPU, compile="aot_eager"), FlexPaged(CPU, compile="aot_eager")
    assert a.warm_up(kv, B, HEADS, torch.float32, max_query=1) == 1
    assert b.warm_up(kv, B, HEADS, torch.float32, max_query=1) == 1
    assert FlexPaged(CPU).compiles == 0 and FlexPaged(CPU).warm_up(kv, B, HEADS, torch.float32, 64) == 0  # eager
