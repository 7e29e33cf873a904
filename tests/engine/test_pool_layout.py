"""The device pool's two layouts (storage/device_pool.py): page-major, and layer-major for pools
past flex_paged's 32-bit offsets.

A Llama-3.1-8B pool of 16 or 24 GiB cannot be allocated here: its layout choice, the backend
choice and the offsets flex's kernels compute are checked by shape (the pool on torch's meta
device). On the CPU, tiny random-weight models run both layouts through the same flex_paged code
the GPU runs (eager there): the same greedy tokens, and every block the same bytes on the device,
in the host slab, on disk and in the store.
"""
from __future__ import annotations

import struct
import warnings

import pytest
import redis
import torch

from engine.attention_backends import FLEX_MAX_POOL_ELEMENTS, GatherSDPA, make_backend, pool_by_layer
from engine.flex_paged import layer_rows
from engine.model import model_from_config
from engine.paged_batch import PagedBatch, SeqSlice
from storage.config import CacheConfig
from storage.device_pool import DevicePool
from storage.hashing import block_keys
from storage.layout import BlockLayout
from storage.remote.url import parse_remote_url
from storage.remote.value import HEAD_SIZE, _SEALED, remote_key
from tests.engine.conftest import random_prompt, reference_greedy, tiny_llama_config
from tieredkv import Engine, SamplingParams

CUDA = torch.device("cuda")       # a device object needs no GPU; nothing is allocated on it
GiB = 1 << 30
LLAMA_8B = BlockLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes from the tensor's data pointer."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


@pytest.mark.parametrize("gib", [16, 24])
def test_a_llama_8b_pool_past_2_31_elements_runs_flex_paged_laid_out_by_layer(monkeypatch, gib):
    """The H200 run's pools (8.7G and 12.9G elements) went to gather_sdpa: now 'auto' lays them out
    layer-major and keeps flex_paged; a 2 GiB pool stays page-major; the layout can be forced."""
    monkeypatch.delenv("TIEREDKV_ATTENTION", raising=False)
    monkeypatch.delenv("TIEREDKV_POOL_LAYOUT", raising=False)
    pages = LLAMA_8B.blocks_in(gib * GiB)
    assert DevicePool.attention_span(LLAMA_8B, pages, False) > FLEX_MAX_POOL_ELEMENTS
    by_layer = pool_by_layer(None, CUDA, 16, LLAMA_8B, pages)
    assert by_layer
    span = DevicePool.attention_span(LLAMA_8B, pages, by_layer)
    assert span == pages * LLAMA_8B.numel // 32 <= FLEX_MAX_POOL_ELEMENTS
    assert make_backend(None, CUDA, 16, span).name == "flex_paged"
    assert make_backend("flex_paged", CUDA, 16, span).name == "flex_paged"
    small = LLAMA_8B.blocks_in(2 * GiB)
    assert not pool_by_layer(None, CUDA, 16, LLAMA_8B, small)          # within reach: as before
    assert not pool_by_layer("gather_sdpa", CUDA, 16, LLAMA_8B, pages)  # gather_sdpa needs no change
    assert not pool_by_layer(None, torch.device("cpu"), 16, LLAMA_8B, pages)
    monkeypatch.setenv("TIEREDKV_POOL_LAYOUT", "page")                  # forced page-major: refused as before
    assert not pool_by_layer(None, CUDA, 16, LLAMA_8B, pages)
    with pytest.raises(ValueError, match="32-bit offsets"):
        make_backend("flex_paged", CUDA, 16, DevicePool.attention_span(LLAMA_8B, pages, False))
    monkeypatch.setenv("TIEREDKV_POOL_LAYOUT", "sideways")
    with pytest.raises(ValueError, match="TIEREDKV_POOL_LAYOUT"):
        pool_by_layer(None, CUDA, 16, LLAMA_8B, pages)


def test_every_layer_view_of_a_24_gib_pool_is_within_flex_offsets():
    """The 24 GiB pool on the meta device (shapes and strides, no memory): layer-major, every
    layer's K and V views -- what flex_paged hands its kernels, their data pointers carrying the
    layer's place -- stay under 2^31 elements from their start, the last page's rows included;
    page-major, the last layer's view reaches 12.9G (the H200's illegal memory access)."""
    pages = LLAMA_8B.blocks_in(24 * GiB)
    pool = DevicePool(LLAMA_8B, pages, "meta", by_layer=True)
    assert pool.kv.shape == (pages, *LLAMA_8B.shape)
    B = LLAMA_8B.block_size
    for layer in range(LLAMA_8B.num_layers):
        k, v = layer_rows(pool.kv, layer)
        assert k.shape == v.shape == ((pages - 1) * 2 * B + B, 8, 128)
        assert _max_offset(k) < 2**31 and _max_offset(v) < 2**31
        assert pool.kv[:, layer].is_contiguous()
        # The views start at the layer's region: K at its first slot, V a block further.
        assert k.storage_offset() == layer * pages * 2 * B * 8 * 128
        assert v.storage_offset() == k.storage_offset() + B * 8 * 128
    flat = DevicePool(LLAMA_8B, pages, "meta")
    k, _ = layer_rows(flat.kv, LLAMA_8B.num_layers - 1)
    assert _max_offset(k) > 2**31


# -- One pass on a random pool in both layouts: the same pages hold the same blocks.

B, L, KV_HEADS, HEADS, D, PAGES = 4, 3, 2, 6, 16, 24
SMALL = BlockLayout(num_layers=L, block_size=B, num_kv_heads=KV_HEADS, head_dim=D, dtype=torch.float32)
# Decodes sharing prefix pages, and prefill chunks starting mid-context (test_attention_backends.py).
MIXED = [(1, 9, (0, 1, 2)), (1, 13, (0, 1, 5, 6)), (1, 2, (3,)),
         (5, 11, (0, 8, 9)), (3, 3, (10,)), (2, 10, (11, 12, 13)), (1, 5, (23, 22))]


def _pools() -> tuple[DevicePool, DevicePool]:
    blocks = torch.randn((PAGES, *SMALL.shape), generator=torch.Generator().manual_seed(0))
    pools = DevicePool(SMALL, PAGES), DevicePool(SMALL, PAGES, by_layer=True)
    for pool in pools:
        for page in range(PAGES):
            pool.kv[page].copy_(blocks[page])
    return pools


def test_a_layer_major_page_is_the_same_block_and_flex_reads_it_like_gather_sdpa():
    """kv[page] of a layer-major pool is the page-major block (same values, same bytes when
    copied out); flex_paged over a layer's region gives gather_sdpa's outputs on every layer."""
    page_major, layer_major = _pools()
    assert page_major.kv.is_contiguous() and not layer_major.kv.is_contiguous()
    for page in range(PAGES):
        assert torch.equal(layer_major.kv[page].contiguous().view(torch.uint8),
                           page_major.kv[page].view(torch.uint8))
    seqs, q = [], 0
    for q_len, ctx, pages in MIXED:
        seqs.append(SeqSlice(q, q_len, ctx, pages))
        q += q_len
    q_all = torch.randn((q, HEADS, D), generator=torch.Generator().manual_seed(1))
    want_batch = PagedBatch(page_major.kv, seqs, B, GatherSDPA(fused=False))
    flex = make_backend("flex_paged", torch.device("cpu"))
    for kv in (page_major.kv, layer_major.kv):
        got_batch = PagedBatch(kv, seqs, B, flex)
        for layer in range(L):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")                  # flex without compile
                for g, w, p in zip(got_batch.groups, want_batch.prepared, got_batch.prepared):
                    want = want_batch.backend.attend(q_all, page_major.kv, layer, g, w, None)
                    got = flex.attend(q_all, kv, layer, g, p, None)
                    torch.testing.assert_close(got.index_select(0, g.res_rows),
                                               want.index_select(0, g.res_rows), rtol=1e-5, atol=1e-5)


# -- Whole engines, CPU, flex_paged: page-major and layer-major give the same tokens and the same
# bytes on every tier.

BS = 4
GREEDY = SamplingParams(max_tokens=6)
PROMPTS = [random_prompt(n, seed=200 + n) for n in (19, 33, 42)]


def _engine(tmp_path, name: str, url: str, attention: str, **kw) -> Engine:
    cache = CacheConfig(block_size=BS, device_memory="256KiB", host_memory="256KiB",
                        disk_dir=str(tmp_path / name / "kv"), disk_capacity="64MiB", remote_url=url)
    return Engine(model_from_config(tiny_llama_config(), seed=0), cache, attention=attention,
                  exact_hits=False, **kw)


def _raw(url: str):
    u = parse_remote_url(url)
    return redis.Redis(host=u.nodes[0][0], port=u.nodes[0][1])


def _tiers_bytes(eng: Engine, keys, raw) -> dict[str, list[bytes]]:
    """Each key's block bytes on the device, then (demoted) in the host slab, then the disk's and
    the store's stored payloads."""
    c = eng.cache
    out = {"device": [c.pool.kv[c.pool.page_of(k)].contiguous().view(torch.uint8).numpy().tobytes()
                      for k in keys]}
    c.demote("device")
    c.transfer.sync_host()
    out["host"] = [c.host.slab[c.host.slot_of(k)].view(torch.uint8).numpy().tobytes() for k in keys]
    assert c.flush().complete
    disk = c.disk
    with disk._begin(buffers=False) as txn:
        out["disk"] = [bytes(txn.get(k.hash, db=disk._payload)) for k in keys]
    out["remote"] = []
    for k in keys:
        value = raw.get(remote_key(k))
        meta_len = struct.unpack_from("<I", value, _SEALED)[0]
        out["remote"].append(value[HEAD_SIZE + meta_len:])
    return out


@pytest.mark.parametrize("attention", ["gather_sdpa", "flex_paged"])
def test_both_layouts_give_the_same_tokens_and_bytes_on_every_tier(tmp_path, monkeypatch, valkey, attention):
    """Page-major, then layer-major (a fresh disk, the store's copies deleted between): the same
    greedy tokens as transformers, cold and from the device, the host and the disk; every block
    the same bytes on the device, in the host slab, on disk and in the store. Then the blocks the
    layer-major engine wrote to the store are remote hits of both layouts (decodes through the
    graph-safe step). flex_paged's CPU path is eager: dense scores over the view, whose length is
    the layout's, so its K/V may differ in the last bit between layouts (the GPU kernel visits the
    same blocks either way): compared there as each layout's device bytes against its slab's."""
    want = [reference_greedy(None, ids, GREEDY.max_tokens) for ids in PROMPTS]
    raw = _raw(valkey.url)
    seen: dict[str, dict[str, list[bytes]]] = {}
    for layout in ("page", "layer"):
        monkeypatch.setenv("TIEREDKV_POOL_LAYOUT", layout)
        with _engine(tmp_path / attention, layout, valkey.url, attention) as eng:
            assert eng.cache.pool.by_layer == (layout == "layer")
            keys = [k for ids in PROMPTS for k in block_keys(eng.namespace("default"), ids, BS,
                                                             max_tokens=len(ids) - 1)]
            raw.delete(*[remote_key(k) for k in keys])            # the store's: this run's own
            assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want, layout
            assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want, layout   # device hits
            seen[layout] = _tiers_bytes(eng, keys, raw)
            assert seen[layout]["device"] == seen[layout]["host"]
            for tier in ("host", "disk"):
                if tier == "disk":
                    eng.cache.demote("device")
                    eng.cache.demote("host")
                    eng.cache.disk.drain()
                outs = eng.generate(PROMPTS, GREEDY)
                assert [o.token_ids for o in outs] == want, (layout, tier)
                assert all(o.usage.hit_tokens_by_tier[tier] > 0 for o in outs), (layout, tier)
            eng.cache.audit()
    if attention == "gather_sdpa":
        for tier in ("device", "host", "disk", "remote"):
            assert seen["page"][tier] == seen["layer"][tier], tier
    for layout in ("page", "layer"):
        monkeypatch.setenv("TIEREDKV_POOL_LAYOUT", layout)
        with _engine(tmp_path / attention, f"{layout}-remote", valkey.url, attention, decode_step="static") as eng:
            outs = eng.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outs] == want, layout
            assert all(o.usage.hit_tokens_by_tier["remote"] > 0 for o in outs), layout


def test_stored_logits_are_the_same_block_bytes_in_either_layout():
    """An exact entry's logits row (storage/exact_entry.py) written into a layer-major pool's
    (strided) pages: the same block bytes as page-major, rest zeroed, and read back whole."""
    from storage.exact_entry import LogitsFormat, read_logits, store_logits
    fmt = LogitsFormat(torch.float32, 2000, SMALL.nbytes)     # 3 pages, the last one partly
    row = torch.randn(2000, generator=torch.Generator().manual_seed(2))
    page_major, layer_major = _pools()
    pages = [7, 2, 9]
    assert fmt.pages == 3
    for pool in (page_major, layer_major):
        store_logits(pool.kv, pages, row, fmt)
        assert torch.equal(read_logits(pool.kv, pages, fmt), row)
    for page in range(PAGES):
        assert torch.equal(layer_major.kv[page].contiguous().view(torch.uint8), page_major.kv[page].view(torch.uint8))
