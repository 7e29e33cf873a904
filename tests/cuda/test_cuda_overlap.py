"""The CUDA path's overlaps on a real GPU (issue 30, item 5): skipped where torch sees no CUDA.

What a user relies on: a hit restored through the loader is bit-identical KV and gives the same
greedy tokens, whichever staging half a disk fill goes through (STAGE_BLOCKS small, so fills
under 64 blocks use both halves), and even when the copies it depends on are still queued
behind other work (torch.cuda._sleep on the transfer and loader streams: a fill reads a host
slot whose copy in has not run yet); a pool of >= 2 GiB through both attention backends gives
transformers' tokens; and the step time the planner learns from (engine/step_timer.py) is the
forward's GPU time, as a pair of CUDA events around the same forward measures it.
Run by tools/gpu_check.sh; `python -m pytest -m cuda` runs them alone.
"""
from __future__ import annotations

import pytest
import torch

from engine.model import model_from_config
from engine.step_timer import StepTimer
from storage import loader as loader_module
from storage.config import CacheConfig
from tests.cuda.test_cuda_path import GREEDY, reference
from tests.engine.conftest import random_prompt, tiny_llama_config
from tieredkv import Engine, SamplingParams

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 200_000_000      # ~0.1 s of one SM's clock: far longer than the CPU code after it


def load_engine(tmp_path, attention="gather_sdpa", device_memory="4MiB") -> Engine:
    """A CUDA engine that always loads its hits (restore_policy="load": the tiny model's recompute
    is so cheap that "auto" would recompute them, and the fills would go untested). Exact hits
    off: these tests count a prompt's full blocks (as tests/engine's prefix-path tests do)."""
    loaded = model_from_config(tiny_llama_config(), seed=0, device="cuda", dtype=torch.float32)
    cache = CacheConfig(block_size=16, device_memory=device_memory, host_memory="4MiB",
                        disk_dir=str(tmp_path / "kv"), disk_capacity="64MiB", restore_policy="load")
    return Engine(loaded, cache, attention=attention, exact_hits=False)


def cached_kv(eng: Engine) -> dict[bytes, torch.Tensor]:
    """Every block the device pool caches: hash -> its bytes (a CPU copy)."""
    pool = eng.cache.pool
    with eng.cache.tiers.lock:
        pages = {pool.key_of(p).hash: p for p in pool.cached_pages()}
    torch.cuda.synchronize()
    return {h: pool.kv[p].cpu() for h, p in pages.items()}


def assert_same_kv(before: dict[bytes, torch.Tensor], after: dict[bytes, torch.Tensor], n: int) -> None:
    common = before.keys() & after.keys()
    assert len(common) >= n, (len(common), n)
    for h in common:
        assert torch.equal(before[h].view(torch.uint8), after[h].view(torch.uint8)), "restored KV differs"


@pytest.mark.parametrize("stage_blocks", [1, 3])
def test_disk_fills_through_both_staging_halves_are_exact(tmp_path, monkeypatch, stage_blocks) -> None:
    """STAGE_BLOCKS of 1 and 3: a 9-block disk fill alternates the two pinned halves, each
    rewritten only once the copies out of it are complete."""
    monkeypatch.setattr(loader_module, "STAGE_BLOCKS", stage_blocks)
    ids = random_prompt(150, seed=3)                  # 9 full blocks of 16
    want = reference(None, ids, 12)
    with load_engine(tmp_path) as eng:
        # One token: the prompt's 9 blocks and no 10th. (With 12, the 10th block fills during the
        # decode; the hit run recomputes its first 6 tokens in a 6-token chunk, not inside a
        # 150-token prefill, so its bytes differ in the last bits -- the H200 run saw exactly that --
        # and it is not restored KV.)
        eng.generate(ids, SamplingParams(max_tokens=1))
        before = cached_kv(eng)
        assert len(before) == 9
        eng.demote("device")
        eng.demote("host")
        assert eng.flush().complete
        eng.drop_tier("host")
        hit = eng.generate(ids, GREEDY)
        assert hit.token_ids == want
        assert hit.usage.hit_tokens_by_tier["disk"] == 144
        assert eng.cache.loader.failed_fills == 0
        assert_same_kv(before, cached_kv(eng), 9)      # every restored block, bit for bit


def test_a_fill_reads_host_slots_whose_copies_in_are_still_queued(tmp_path) -> None:
    """The transfer stream sleeps before the device -> host copies of a demote; the loader's
    stream sleeps before the fill; the request is admitted while the copies into its slots are
    still queued. The fill's stream waits for them device-side: exact KV, same tokens."""
    ids = random_prompt(100, seed=5)                  # 6 full blocks
    want = reference(None, ids, 12)
    with load_engine(tmp_path) as eng:
        assert eng.generate(ids, GREEDY).token_ids == want
        before = cached_kv(eng)
        cache = eng.cache
        torch.cuda.synchronize()
        with torch.cuda.stream(cache.transfer.stream):
            torch.cuda._sleep(SLEEP_CYCLES)            # the copies out queue behind this
        assert eng.demote("device") == 6
        with cache.tiers.lock:
            slots = [slot for slot, _ in cache.host.blocks()]
            queued = [not cache.transfer.ready(slot) for slot in slots]
        assert len(slots) == 6 and all(queued), "the copies into the host slots already ran"
        with torch.cuda.stream(cache.loader._stream):
            torch.cuda._sleep(SLEEP_CYCLES)            # and the fill's copies behind this
        hit = eng.generate(ids, GREEDY)
        assert hit.token_ids == want
        assert hit.usage.hit_tokens_by_tier["host"] == 96
        assert cache.stats()["host"].promotions == 6 and cache.loader.failed_fills == 0
        assert_same_kv(before, cached_kv(eng), 6)


@pytest.mark.parametrize("attention", ["gather_sdpa", "flex_paged"])
def test_a_two_gib_pool_gives_transformers_tokens(tmp_path, attention) -> None:
    """A pool of 2 GiB (hundreds of thousands of tiny-model pages): the attention reads only the
    batch's pages (an eager fallback over the whole pool would materialise scores against every
    page), and every tier's hit gives the computed tokens."""
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 100)]
    with load_engine(tmp_path, attention, device_memory="2GiB") as eng:
        assert eng.cache.pool.kv.numel() * eng.cache.pool.kv.element_size() >= 2 << 30
        assert eng.cache_status()["engine"]["attention"] == attention
        for ids in prompts:
            want = reference(None, ids, 12)
            assert eng.generate(ids, GREEDY).token_ids == want            # computed
            assert eng.generate(ids, GREEDY).token_ids == want            # device hit
            eng.demote("device")
            assert eng.generate(ids, GREEDY).token_ids == want            # host hit
        outs = eng.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [reference(None, ids, 12) for ids in prompts]


def test_the_step_timer_records_the_forwards_gpu_time() -> None:
    """StepTimer around a real forward (launched while the GPU is still busy with a queued sleep,
    so the forward's GPU span is not its launch time) hands over nothing until its end event has
    completed -- it never waits -- and then the time a pair of CUDA events around the same
    launches measures, within the few microseconds between the two pairs' records."""
    model = model_from_config(tiny_llama_config(), seed=0, device="cuda", dtype=torch.float32).model
    ids = torch.tensor([random_prompt(300, seed=9)], device="cuda")
    seen: list[tuple[list, float]] = []
    timer = StepTimer(torch.device("cuda"), lambda work, s: seen.append((work, s)))
    with torch.no_grad():
        model(ids)                                     # warm: kernels loaded, allocator primed
        torch.cuda.synchronize()
        outer0, outer1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        outer0.record()
        mark = timer.start()
        torch.cuda._sleep(SLEEP_CYCLES)                # the GPU is behind the CPU from here on
        model(ids)
        timer.stop(mark, [(300, 0)])
        outer1.record()
        timer.collect()
        assert seen == [], "the timer read a step whose end event had not completed"
        outer1.synchronize()
        timer.collect()
    outer = outer0.elapsed_time(outer1) / 1000.0
    assert len(seen) == 1 and seen[0][0] == [(300, 0)]
    recorded = seen[0][1]
    assert 0.9 * outer <= recorded <= outer, (recorded, outer)
    assert recorded > 0.01                              # the sleep is in it: GPU time, not launch time
