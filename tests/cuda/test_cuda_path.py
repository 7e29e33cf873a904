"""The CUDA path, on a real GPU (issue 9): skipped where torch sees no CUDA device.

What a user of the GPU path relies on: greedy tokens identical to transformers' own on the same
GPU (every tier, every attention backend), no host synchronisation inside a step's forward and
sampling, a pinned host tier of the size asked for (not rounded to a power of two), and a
demotion that stores the page's final bytes even when the compute stream is far behind the CPU.
Run by tools/gpu_check.sh; `python -m pytest -m cuda` runs them alone.
"""
from __future__ import annotations

import pytest
import torch

from engine.model import model_from_config
from storage.config import CacheConfig
from storage.host_tier import HostTier
from storage.tiered_cache import TieredKVCache
from tests.engine.conftest import random_prompt, tiny_llama_config, tiny_qwen2_config
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import same_bits
from tieredkv import Engine, SamplingParams

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=12)


def cuda_engine(tmp_path, config=None, dtype=torch.float32, **kw) -> Engine:
    loaded = model_from_config(config or tiny_llama_config(), seed=0, device="cuda", dtype=dtype)
    cache = CacheConfig(block_size=16, device_memory=kw.pop("device_memory", "4MiB"), host_memory="4MiB",
                        disk_dir=str(tmp_path / "kv"), disk_capacity="64MiB")
    kw.setdefault("exact_hits", False)   # the parity tests count a prompt's full blocks as hits
    return Engine(loaded, cache, **kw)


def reference(config, ids: list[int], n: int, dtype=torch.float32) -> list[int]:
    model = model_from_config(config or tiny_llama_config(), seed=0, device="cuda", dtype=dtype).model
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("attention", ["gather_sdpa", "flex_paged"])
@pytest.mark.parametrize("config", [None, tiny_qwen2_config()], ids=["llama", "qwen2"])
def test_greedy_parity_with_transformers_on_every_tier(tmp_path, config, attention) -> None:
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 37, 100)]
    with cuda_engine(tmp_path, config, attention=attention) as eng:
        assert eng.cache_status()["engine"]["attention"] == attention
        for ids in prompts:
            want = reference(config, ids, 12)
            assert eng.generate(ids, GREEDY).token_ids == want            # computed
            assert eng.generate(ids, GREEDY).token_ids == want            # device hit
            eng.demote("device")
            hit = eng.generate(ids, GREEDY)                               # host hit
            assert hit.token_ids == want
            assert hit.usage.hit_tokens_by_tier["host"] == (len(ids) - 1) // 16 * 16
            eng.demote("device")
            eng.demote("host")
            eng.flush()
            assert eng.generate(ids, GREEDY).token_ids == want            # disk hit
        # A batch of them at once: decodes and prefills share steps.
        outs = eng.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [reference(config, ids, 12) for ids in prompts]


@pytest.mark.parametrize("attention", ["gather_sdpa", "flex_paged"])
def test_no_host_sync_inside_a_step(tmp_path, attention) -> None:
    """The device part of every step (metadata upload, forward, sampling) runs with
    torch.cuda.set_sync_debug_mode('error'): any implicit synchronisation there raises, which
    fails the request. Prefill chunks, decodes, cache hits and sampled requests all go through."""
    prompts = [random_prompt(n, seed=100 + n) for n in (7, 33, 64, 130)]
    with cuda_engine(tmp_path, max_batch_tokens=48, attention=attention) as plain:
        want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    with cuda_engine(tmp_path / "checked", max_batch_tokens=48, sync_debug="error", attention=attention) as eng:
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want        # from the cache
        sampled = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20,
                                                       seed=7, logprobs=3))
        assert all(len(o.token_ids) == 8 for o in sampled)


def test_pinned_slab_is_the_configured_size() -> None:
    """5 MiB + a bit, not a power of two: the caching host allocator would have reserved 8 MiB."""
    size = 5 * (1 << 20) + 3 * TINY.nbytes
    before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) if hasattr(torch.cuda, "host_memory_stats") else 0
    host = HostTier(TINY, size, pin=True)
    assert host.pinned and host.slab.is_pinned()
    reserved = host.pinned_bytes + (torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) - before
                                    if hasattr(torch.cuda, "host_memory_stats") else 0)
    assert abs(reserved - size) <= 0.01 * size, (reserved, size)
    host.slab[3].copy_(block_data(keys(1)[0]))                    # usable as ordinary memory
    assert same_bits(host.slab[3], block_data(keys(1)[0]))
    host.close()


def test_demote_behind_a_slow_compute_stream_stores_the_final_bytes(tmp_path) -> None:
    """The compute stream sleeps before it writes the pages; the CPU demotes them at once. The
    copy out is ordered after the writes, and the disk put waits for the copy."""
    config = CacheConfig(block_size=TINY.block_size, device_memory=8 * TINY.nbytes, host_memory=4 * TINY.nbytes,
                         disk_dir=str(tmp_path / "kv"), disk_capacity=64 << 20, write_policy="write_through")
    cache = TieredKVCache(TINY, config, "cuda", num_pages=8)
    ks = keys(6)
    data = [block_data(k).cuda() for k in ks]
    torch.cuda.synchronize()
    for k, d in zip(ks, data):
        page = cache.allocate(1)[0]
        torch.cuda._sleep(20_000_000)           # ~10 ms of GPU time before the write lands
        cache.pool.kv[page].copy_(d, non_blocking=True)
        cache.register(page, k)                # write-through: host copy + disk put, right now
        cache.release([page])
    cache.demote("device")
    assert cache.flush(timeout=60).complete
    for k in ks:
        got = cache.disk.get(k)
        assert got is not None and same_bits(got.view(TINY.shape), block_data(k)), "stale bytes on disk"
    cache.close()


def test_a_fill_waits_for_the_compute_streams_writes_into_its_page_even_without_a_copy_out() -> None:
    """Issue 18: the mark a fill's stream waits on (Transfer.issued) covers the compute stream's
    queued writes, not only copies out. A page written by a long queued kernel and never copied
    out is read by another stream after the mark: it must see the kernel's bytes."""
    from storage.transfer import Transfer
    t = Transfer(torch.device("cuda"))
    page = torch.zeros(1 << 20, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):                     # keep the compute stream busy well past this CPU code
        big = big @ big / 64
    page.fill_(7.0)                         # the "forward's K/V write", queued behind the matmuls
    mark = t.issued()                       # no copy out was issued for this page
    fill = torch.cuda.Stream()
    with torch.cuda.stream(fill):
        fill.wait_event(mark)
        seen = page.clone()                 # what a fill's stream would overwrite (or read)
    fill.synchronize()
    assert bool((seen == 7.0).all())


# Issue 18 item 6, at the backend: the pass of tests/engine/test_attention_backends.py with block
# size 16 (flex's kernel block): GQA, decodes padded to one context, prefill chunks padded to one
# Q and starting mid-context, shared prefix pages; then two one-sequence groups.
MIXED16 = [(1, 33, (0, 1, 2)), (1, 50, (0, 1, 5, 6)), (1, 5, (3,)),
           (20, 40, (0, 8, 9)), (7, 7, (10,)), (3, 30, (11, 12))]
SINGLES16 = [(1, 20, (4, 5)), (24, 40, (6, 7, 8))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sdpa_runs_a_fused_kernel_and_flex_paged_agrees(dtype) -> None:
    """gather_sdpa's CUDA form runs with SDPA's math kernel disabled -- so flash (one-sequence
    groups, bf16) or memory-efficient (the folded form) ran, not fp32 scores -- and gives the
    plain call's outputs (math kernel); compiled flex_paged, whose block index is only the
    group's blocks wide, gives them too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from engine.attention_backends import GatherSDPA, make_backend
    from tests.engine.test_attention_backends import _outputs, _pass
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for specs in (MIXED16, SINGLES16):
        plain, kv, q_all = _pass(specs, GatherSDPA(fused=False), block=16, device="cuda", dtype=dtype)
        want = _outputs(plain, kv, q_all)
        fused, _, _ = _pass(specs, GatherSDPA(), block=16, device="cuda", dtype=dtype)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            got = _outputs(fused, kv, q_all)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, **tol)
        flex, _, _ = _pass(specs, make_backend("flex_paged", torch.device("cuda"), 16), block=16,
                           device="cuda", dtype=dtype)
        for a, b in zip(want, _outputs(flex, kv, q_all)):
            torch.testing.assert_close(b, a, **tol)
