"""The attention backends: which one starts, and flex_paged's greedy parity on the CPU.

flex_paged is the CUDA default; its CPU path (flex_attention unfused, eager) is slow but runs the
same block mask and the same flat-pool view as on a GPU, so a wrong page index, a wrong causal
offset or a wrong context length shows up here as a different greedy token.
"""
import warnings

import pytest
import torch

from engine.attention_backends import BACKENDS, GatherSDPA, make_backend
from engine.paged_batch import PagedBatch, SeqSlice
from tests.engine.conftest import (make_engine, random_prompt, reference_greedy, tiny_llama_config,
                                   tiny_qwen2_config)
from tieredkv import SamplingParams

GREEDY = SamplingParams(max_tokens=8)
CPU = torch.device("cpu")


def test_auto_is_gather_sdpa_on_cpu_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv("TIEREDKV_ATTENTION", raising=False)
    assert make_backend(None, CPU).name == "gather_sdpa"
    assert make_backend("auto", CPU).name == "gather_sdpa"
    monkeypatch.setenv("TIEREDKV_ATTENTION", "flex_paged")
    assert make_backend("auto", CPU).name == "flex_paged"
    assert make_backend("gather_sdpa", CPU).name == "gather_sdpa"   # an explicit name wins
    assert set(BACKENDS) == {"gather_sdpa", "flex_paged"}


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention: expected one of"):
        make_backend("flash", CPU)


def test_an_engine_builds_its_attention_backend_once(monkeypatch):
    """The backend the engine picks (its name sets the decode mode) is the one its runner runs: one
    FlexPaged per engine, not a second built and warmed by the runner (issue 32's review)."""
    import engine.attention_backends as backends
    built = []

    class Counted(backends.FlexPaged):
        def __init__(self, *args, **kwargs) -> None:
            built.append(self)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(backends, "FlexPaged", Counted)
    with make_engine(None, block_size=16, attention="flex_paged", calibrate=False) as eng:
        assert built == [eng.runner.backend]
        assert eng.cache_status()["engine"]["attention"] == "flex_paged"


@pytest.mark.parametrize("config", [None, tiny_qwen2_config()], ids=["llama", "qwen2"])
def test_flex_paged_greedy_equals_transformers_with_hits_from_every_tier(tmp_path, config):
    """Block size 16 (flex's kernel block on CUDA): a batch of three prompts, then each again
    from the device pool, the host tier and the disk tier, every output equal to plain
    transformers (each an exact hit: its first token from the stored logits, the rest decoded
    by flex over the restored pages, the partial last one copied on write)."""
    prompts = [random_prompt(n, seed=n) for n in (21, 40, 57)]
    want = [reference_greedy(config, ids, GREEDY.max_tokens) for ids in prompts]
    with make_engine(tmp_path, config, block_size=16, attention="flex_paged") as eng:
        assert eng.cache_status()["engine"]["attention"] == "flex_paged"
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want      # batched, cold
        for tier in ("device", "host", "disk"):
            if tier != "device":
                eng.cache.demote("device")
            if tier == "disk":
                eng.cache.demote("host")
                eng.cache.disk.drain()
            outs = eng.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == want, tier
            hits = [o.usage.hit_tokens_by_tier[tier] for o in outs]
            assert hits == [21, 40, 57], tier        # exact hits: every prompt token (issue 29)
        eng.cache.audit()


def test_flex_paged_and_gather_sdpa_agree_on_chunked_prefill_and_small_blocks(tmp_path):
    """Block size 4 and 16-token prefill chunks: many pages per sequence, queries that start
    mid-context; both backends give the same tokens as transformers."""
    ids = random_prompt(45, seed=3)
    want = reference_greedy(None, ids, GREEDY.max_tokens)
    for name in ("gather_sdpa", "flex_paged"):
        with make_engine(tmp_path / name, attention=name, max_batch_tokens=16) as eng:
            assert eng.generate(ids, GREEDY).token_ids == want, name
            assert eng.generate(ids, GREEDY).token_ids == want, name     # from the cache


# -- One pass's groups through each backend on a random pool: GQA (6 query heads over 2 KV
# heads), block size 4, decodes padded to the longest context, prefill chunks of different
# lengths padded to one Q and starting mid-context, prefix pages shared between sequences.

B, L, KV_HEADS, HEADS, D, PAGES = 4, 2, 2, 6, 16, 24


def _pass(specs: list[tuple[int, int, tuple[int, ...]]], backend, *, block: int = B, seed: int = 0,
          device: str = "cpu", dtype: torch.dtype = torch.float32):
    """specs: (q_len, context_len, pages) per sequence -> (batch, pool, packed queries)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((PAGES, L, 2, block, KV_HEADS, D), generator=gen).to(device, dtype)
    seqs, q = [], 0
    for q_len, ctx, pages in specs:
        seqs.append(SeqSlice(q, q_len, ctx, pages))
        q += q_len
    q_all = torch.randn((q, HEADS, D), generator=gen).to(device, dtype)
    return PagedBatch(kv, seqs, block, backend), kv, q_all


def _outputs(batch, kv, q_all, layer: int = 1) -> list[torch.Tensor]:
    """Each group's rows of its real queries (padded rows differ by backend, and are dropped)."""
    return [batch.backend.attend(q_all, kv, layer, g, p, None).index_select(0, g.res_rows)
            for g, p in zip(batch.groups, batch.prepared)]


# Decodes (q_len 1) share pages 0 and 1 at logical blocks 0 and 1; the prefills (chunks of 5, 3
# and 2 queries over 11, 3 and 10 keys) form one padded group, the first sharing page 0 too.
MIXED = [(1, 9, (0, 1, 2)), (1, 13, (0, 1, 5, 6)), (1, 2, (3,)),
         (5, 11, (0, 8, 9)), (3, 3, (10,)), (2, 10, (11, 12, 13))]


def test_gather_sdpa_fused_form_equals_the_plain_call_on_mixed_groups():
    """The CUDA form (query heads folded onto the query axis, additive mask in q's dtype, no
    enable_gqa), forced on the CPU, gives the plain call's outputs (fp32, tight)."""
    plain, kv, q_all = _pass(MIXED, GatherSDPA(fused=False))
    fused, _, _ = _pass(MIXED, GatherSDPA(fused=True))
    assert [g.size for g in plain.groups] == [3, 3]
    for layer in range(L):
        for a, b in zip(_outputs(plain, kv, q_all, layer), _outputs(fused, kv, q_all, layer)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert all(list(p.folded) == [(HEADS // KV_HEADS, torch.float32)] for p in fused.prepared)  # built once


def test_gather_sdpa_fused_form_for_one_sequence_groups_is_lower_right_causal(monkeypatch):
    """A one-sequence group takes flash's route on CUDA (no mask, lower-right causal, GQA): forced
    here (the CPU runs torch's materialized CausalBias), same outputs as the plain call."""
    specs = [(1, 7, (4, 5)), (4, 10, (6, 7, 8))]          # a decode alone; a chunk starting at 6
    monkeypatch.setattr(GatherSDPA, "_flash_ok", staticmethod(lambda q, k, v: True))
    plain, kv, q_all = _pass(specs, GatherSDPA(fused=False))
    fused, _, _ = _pass(specs, GatherSDPA(fused=True))
    assert [g.size for g in plain.groups] == [1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # CausalBias: "no fused kernel" on the CPU
        got = _outputs(fused, kv, q_all)
    for a, b in zip(_outputs(plain, kv, q_all), got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert all(not p.folded for p in fused.prepared)      # no mask built


def test_flex_paged_equals_gather_sdpa_with_shared_pages_and_its_block_index_covers_the_mask():
    """flex_paged (eager on the CPU) gives gather_sdpa's outputs on the mixed pass; its block index
    is as wide as the group's blocks (a power of two), not the pool view, and every key the
    mask_mod admits lies in a block among the first kv_num entries of its row -- all the Triton
    kernels read."""
    plain, kv, q_all = _pass(MIXED, GatherSDPA(fused=False))
    flex, _, _ = _pass(MIXED, make_backend("flex_paged", CPU))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # flex without compile
        got = _outputs(flex, kv, q_all)
    for a, b in zip(_outputs(plain, kv, q_all), got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    M = (PAGES - 1) * 2 * L * B + B
    for g, p in zip(flex.groups, flex.prepared):
        bm = p.block_mask
        S, nb = g.block_table.shape
        assert bm.kv_indices.shape[-1] == max(2, 1 << (nb - 1).bit_length()) < M // B
        assert bm.full_kv_indices is None and bm.q_indices is None
        admitted = bm.mask_mod(torch.arange(S)[:, None, None], 0, torch.arange(g.max_q)[None, :, None],
                               torch.arange(M)[None, None, :])                     # [S, Q, M]
        q_block = bm.BLOCK_SIZE[0]
        for b, q, k in admitted.nonzero().tolist():
            row = bm.kv_indices[b, 0, q // q_block, :bm.kv_num_blocks[b, 0, q // q_block]]
            assert k // B in row.tolist()
        assert int(admitted.sum()) == sum(min(qf + j + 1, c) for qf, ql, c in zip(
            g.q_first.tolist(), g.q_len.tolist(), g.context_len.tolist()) for j in range(ql))


def test_flex_paged_is_never_given_a_pool_past_its_32_bit_offsets() -> None:
    """One layer's view of the pool spanning more KV elements than flex_paged's kernels address
    (the H200 run: an illegal memory access at 8.7G elements, page-major): 'auto' on CUDA takes
    gather_sdpa, a named flex_paged is a clear error, and a span within the bound keeps flex_paged.
    The engine lays such a pool out by layer instead (tests/engine/test_pool_layout.py)."""
    from engine.attention_backends import FLEX_MAX_POOL_ELEMENTS, make_backend
    cuda = torch.device("cuda")       # a device object needs no GPU; nothing is allocated
    assert make_backend(None, cuda, 16, FLEX_MAX_POOL_ELEMENTS + 1).name == "gather_sdpa"
    assert make_backend(None, cuda, 16, FLEX_MAX_POOL_ELEMENTS).name == "flex_paged"
    with pytest.raises(ValueError, match="32-bit offsets"):
        make_backend("flex_paged", cuda, 16, 2**33)


@pytest.mark.parametrize("layer_major", [False, True])
def test_gather_sdpa_copies_whole_pages_yet_reads_every_position_from_its_own_page_and_slot(layer_major):
    """The CPU gather copies a page's [slot, head, dim] slab at a time (index_select). Every position
    below a group's context must still be the K/V of (its sequence's page pos // block, slot pos %
    block) -- checked against that per-position index on the mixed pass (shared prefix pages,
    padded groups, sequences of different contexts), page-major and layer-major pools, every layer."""
    batch, kv, _ = _pass(MIXED, GatherSDPA(fused=False), seed=3)
    if layer_major:      # the same values in memory laid out [layer, page, ...]; kv a permuted view
        kv = kv.permute(1, 0, 2, 3, 4, 5).contiguous().permute(1, 0, 2, 3, 4, 5)
        assert not kv.is_contiguous()
    for g, prepared in zip(batch.groups, batch.prepared):
        S, C = g.size, g.max_context
        pos = torch.arange(C)
        pages = g.block_table.gather(1, (pos // B).expand(S, C))
        for layer in range(L):
            for which in (0, 1):
                got = GatherSDPA.gather(kv, layer, which, g, prepared.pages)
                assert got.shape == (S, C, KV_HEADS, D)
                assert torch.equal(got, kv[pages, layer, which, (pos % B).expand(S, C)])
