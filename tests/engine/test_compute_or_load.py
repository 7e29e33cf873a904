"""Issue 18, item 2: compute or load, and both at once -- on a real tiny engine and real LMDB.

The planner's figures (each tier's restore rate, the prefill time) are measured online; here
they are fixed numbers set on the engine's planner, so the split each test needs is forced and
can be worked out by hand. Everything else is real: pages, fills, the disk tier, the forward.

These count the blocks a prefix hit loads or recomputes: their engines keep no exact entries
(exact_hits=False; exact hits are tests/engine/test_exact_hits.py's)."""
from __future__ import annotations

import threading
import time

import lmdb

from storage.hashing import block_keys
from tests.engine.conftest import make_engine, random_prompt, reference_greedy
from tests.engine.test_async_restore import DriveGate, hold_deadlines, to_disk_only
from tests.engine.test_restore_planner import Figures
from tieredkv import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6)


def force_figures(eng, block_s: float, token_s: float) -> None:
    """Every tier restores a block in `block_s`; a prefill costs `token_s` a token."""
    rate = eng.layout.nbytes / block_s
    f = Figures({"host": rate, "disk": rate, "remote": rate}, token_s)
    eng.planner.rates = eng.planner.prefill = f


def test_a_split_hit_computes_its_front_loads_its_back_and_equals_recompute(tmp_path) -> None:
    prompt = random_prompt(15 * BS + 3, seed=21)      # 15 full blocks can hit
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make_engine(tmp_path, exact_hits=False) as eng:
        assert eng.generate(prompt, GREEDY).token_ids == expected
        to_disk_only(eng)
        force_figures(eng, block_s=1.0, token_s=0.25)   # the crossing is s = 7 (test_restore_planner)
        before = eng.cache.stats()["disk"]
        out = eng.generate(prompt, GREEDY)
        after = eng.cache.stats()["disk"]
        status = eng.cache_status()
    assert out.token_ids == expected
    # Billed from the tier that held the blocks, loaded or not: the choice is ours.
    assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 15 * BS, "remote": 0}
    assert out.usage.prompt_cache_miss_tokens == 3
    assert out.metrics.recomputed_hit_tokens == 7 * BS
    assert after.promotions - before.promotions == 8               # blocks 7..14 were loaded
    assert after.recomputed - before.recomputed == 7               # blocks 0..6 were computed
    assert after.hits - before.hits == 15
    assert status["tiers"]["disk"]["recomputed_hit_tokens"] == 7 * BS
    assert status["cost_model"]["planner"]["decisions"]["split"] == 1


def test_the_front_is_computed_while_the_back_still_loads(tmp_path, monkeypatch) -> None:
    prompt = random_prompt(15 * BS + 3, seed=22)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make_engine(tmp_path, exact_hits=False) as eng:
        eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        force_figures(eng, block_s=1.0, token_s=0.25)
        gate = DriveGate(monkeypatch)
        hold_deadlines(eng)
        gate.open.clear()                              # the back's disk read waits at the drive
        result = {}
        t = threading.Thread(target=lambda: result.update(out=eng.generate(prompt, GREEDY)))
        t.start()
        front_done_while_loading = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not front_done_while_loading:
            for seq in list(eng.scheduler.running):
                load = seq.load
                if load is not None and seq.num_computed == seq.compute_until == 7 * BS and not load.ready():
                    front_done_while_loading = True
            time.sleep(0.002)
        gate.open.set()
        t.join(60)
    assert front_done_while_loading and not gate.timed_out
    assert result["out"].token_ids == expected
    assert "tieredkv-engine" not in gate.read_threads + gate.decode_threads


def test_recompute_policy_loads_nothing_and_bills_the_tier(tmp_path) -> None:
    prompt = random_prompt(9 * BS + 1, seed=23)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make_engine(tmp_path, exact_hits=False, restore_policy="recompute") as eng:
        eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        before = eng.cache.stats()["disk"]
        out = eng.generate(prompt, GREEDY)
        after = eng.cache.stats()["disk"]
        again = eng.generate(prompt, GREEDY)            # now on the device: a device hit, no choice
    assert out.token_ids == again.token_ids == expected
    assert out.usage.hit_tokens_by_tier["disk"] == 9 * BS and out.metrics.recomputed_hit_tokens == 9 * BS
    assert after.promotions == before.promotions and after.recomputed - before.recomputed == 9
    assert again.usage.hit_tokens_by_tier["device"] == 9 * BS and again.metrics.recomputed_hit_tokens == 0


def test_a_damaged_back_block_is_recomputed_and_billed_as_computed(tmp_path) -> None:
    prompt = random_prompt(12 * BS + 2, seed=24)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make_engine(tmp_path, exact_hits=False) as eng:
        eng.generate(prompt, GREEDY)
        eng.flush()
        hashes = [k.hash for k in block_keys(eng.namespace("default"), prompt, BS, max_tokens=len(prompt) - 1)]
    # The engine is closed: its store is damaged behind its back. Block 9 of 12 (in the loaded back: the split is at 6) gets one byte flipped.
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            v = bytearray(txn.get(hashes[9], db=db))
            v[len(v) // 2] ^= 0x10
            txn.put(hashes[9], bytes(v), db=db)
    finally:
        env.close()
    with make_engine(tmp_path, exact_hits=False) as eng:
        force_figures(eng, block_s=1.0, token_s=0.25)   # 12 blocks: compute(0..6) = 6 = load(6..12)
        out = eng.generate(prompt, GREEDY)
        disk = eng.cache.stats()["disk"]
    assert out.token_ids == expected
    # Blocks 0-5 recomputed (hits), 6-8 loaded (hits), 9 damaged: it and what follows computed.
    assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 9 * BS, "remote": 0}
    assert out.usage.prompt_cache_miss_tokens == 3 * BS + 2
    assert out.metrics.recomputed_hit_tokens == 6 * BS
    assert disk.extra["corrupt"] >= 1


def test_preempting_a_split_hit_gives_its_loading_back_and_it_still_equals_recompute(tmp_path, monkeypatch) -> None:
    """A split hit waits for its back (held at the drive) when a long request needs its pages:
    it is preempted, its back part is given back mid-load, and on re-admission it loads what
    the cache holds. Its bill stays the first admission's."""
    split_prompt = random_prompt(15 * BS + 3, seed=25)
    long_prompt = random_prompt(40 * BS, seed=26)
    expected = reference_greedy(None, split_prompt, GREEDY.max_tokens)
    expected_long = reference_greedy(None, long_prompt, GREEDY.max_tokens)
    # 48 pages of one block; chunks of 4 blocks, so the long prompt is admitted with a few pages
    # and takes the rest step by step, preempting the newest other sequence.
    with make_engine(tmp_path, exact_hits=False, device_memory=48 * 2048, max_batch_tokens=4 * BS) as eng:
        assert eng.layout.nbytes == 2048
        eng.generate(split_prompt, GREEDY)
        to_disk_only(eng)
        force_figures(eng, block_s=1.0, token_s=0.25)      # split at 7 of 15
        gate = DriveGate(monkeypatch)
        hold_deadlines(eng)
        gate.open.clear()
        result = {}
        a = threading.Thread(target=lambda: result.update(a=eng.generate(split_prompt, GREEDY)))
        a.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                s.load is not None and s.num_computed == s.compute_until for s in list(eng.scheduler.running)):
            time.sleep(0.002)
        b = threading.Thread(target=lambda: result.update(b=eng.generate(long_prompt, GREEDY)))
        b.start()
        while time.monotonic() < deadline and eng.scheduler.preemptions == 0:
            time.sleep(0.002)
        preempted_while_loading = eng.scheduler.preemptions >= 1 and not gate.timed_out
        gate.open.set()
        a.join(60)
        b.join(60)
        eng.cache.audit()
        in_use = eng.cache.pool.stats().in_use_pages
    assert preempted_while_loading
    assert result["a"].token_ids == expected and result["b"].token_ids == expected_long
    assert result["a"].usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 15 * BS, "remote": 0}
    assert result["a"].metrics.recomputed_hit_tokens == 7 * BS
    assert in_use == 0
