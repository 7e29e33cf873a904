"""Issue 8, item 1: restores run off the engine thread.

A real tiny engine over a real LMDB disk tier. To hold a restore "on the drive" for as long as a
test needs, DiskTier.get_many is wrapped: the wrapper records which thread called it and, while
a gate is closed, waits before doing the real read (nothing is mocked: every byte still comes
from LMDB through the real codec). On the old code the engine thread made that call inside
admission, so a closed gate stopped every other request's decoding. The engines here restore
every hit (restore_policy="load"): the engine's calibration at start gives the compute-or-load
planner figures from the first request, and it could recompute a tiny model's hit instead.

These count the blocks a prefix hit loads or recomputes: their engines keep no exact entries
(exact_hits=False; exact hits are tests/engine/test_exact_hits.py's)."""
from __future__ import annotations

import threading
import time

import pytest

from storage.codec import block_batch
from storage.codec.payload import Codec
from storage.disk.tier import DiskTier
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from storage.hashing import block_keys
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6)


class DriveGate:
    """Wraps DiskTier.get_many and Codec.decode: records calling threads, holds reads while closed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.timed_out = False             # a read got through a closed gate (its 10 s bound)
        self.read_threads: list[str] = []
        self.decode_threads: list[str] = []
        real_get_many, real_decode = DiskTier.get_many, Codec.decode
        gate = self

        def get_many(tier, keys, outs=None):
            gate.read_threads.append(threading.current_thread().name)
            gate.entered.set()
            if not gate.open.wait(timeout=10):     # bounded: the old code's engine thread gets through
                gate.timed_out = True
            return real_get_many(tier, keys, outs)

        def decode(codec, *args, **kw):
            gate.decode_threads.append(threading.current_thread().name)
            return real_decode(codec, *args, **kw)

        # A block handed to the compiled batch (storage/codec/block_batch.py) is decoded there, by
        # threads the handing thread starts and joins: counted as that thread's decode.
        real_add = block_batch.BlockBatch.add

        def add(batch, *block):
            gate.decode_threads.append(threading.current_thread().name)
            return real_add(batch, *block)

        monkeypatch.setattr(DiskTier, "get_many", get_many)
        monkeypatch.setattr(Codec, "decode", decode)
        monkeypatch.setattr(block_batch.BlockBatch, "add", add)


def hold_deadlines(eng) -> None:
    """The scheduler's clock stands still: no load reaches its deadline (engine/load_deadline.py),
    however long a test holds it at the drive (tests/engine/test_load_deadline.py moves it)."""
    eng.scheduler.clock = lambda: 0.0


def to_disk_only(eng) -> None:
    """Every cached block of the engine ends up on disk only (device and host emptied)."""
    eng.cache.demote("device")
    eng.cache.demote("host")
    assert eng.cache.disk.drain()
    eng.cache.drop("host")
    assert eng.cache.stats()["device"].blocks == 0 and eng.cache.stats()["host"].blocks == 0


def test_engine_thread_never_reads_or_decodes_a_disk_block(tmp_path, monkeypatch) -> None:
    prompt = random_prompt(8 * BS + 3, seed=11)
    with make_engine(tmp_path, exact_hits=False, restore_policy="load") as eng:
        first = eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        gate = DriveGate(monkeypatch)
        again = eng.generate(prompt, GREEDY)
    assert again.token_ids == first.token_ids
    assert again.usage.hit_tokens_by_tier["disk"] == 8 * BS         # billed where the bytes were
    assert again.usage.prompt_cache_miss_tokens == 3
    assert gate.read_threads and gate.decode_threads                 # the disk was really read...
    assert "tieredkv-engine" not in gate.read_threads + gate.decode_threads   # ...never by the engine thread


def test_other_requests_keep_decoding_while_a_restore_waits_on_the_drive(tmp_path, monkeypatch) -> None:
    restored = random_prompt(8 * BS + 3, seed=12)
    runner = random_prompt(2 * BS + 1, seed=13)
    with make_engine(tmp_path, exact_hits=False, restore_policy="load") as eng:
        first = eng.generate(restored, GREEDY)
        to_disk_only(eng)
        gate = DriveGate(monkeypatch)
        hold_deadlines(eng)
        gate.open.clear()
        stamps: list[float] = []

        def run_long() -> None:
            for chunk in eng.stream(runner, SamplingParams(max_tokens=200, ignore_eos=True)):
                stamps.extend([time.monotonic()] * len(chunk.token_ids))

        long = threading.Thread(target=run_long)
        long.start()
        while not stamps:
            time.sleep(0.005)
        result = {}
        waiter = threading.Thread(target=lambda: result.update(out=eng.generate(restored, GREEDY)))
        waiter.start()
        assert gate.entered.wait(10)
        # The restore is held on the "drive" until the running request made 10 more tokens:
        # counted, not timed (a loaded machine makes them slower, never fewer). The old code's
        # engine thread sat in the held read: no token until the gate's own 10 s bound.
        held_from = len(stamps)
        deadline = time.monotonic() + 60
        while len(stamps) < held_from + 10 and long.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        during = len(stamps) - held_from
        still_held = "out" not in result and not gate.timed_out
        gate.open.set()
        waiter.join(30)
        long.join(60)
    assert during >= 10 and still_held, f"the running request made {during} tokens while a restore waited"
    out = result["out"]
    assert out.token_ids == first.token_ids and out.usage.hit_tokens_by_tier["disk"] == 8 * BS
    assert len(stamps) == 200


@pytest.mark.parametrize("host_memory", ["256KiB", "0"])
def test_two_requests_needing_the_same_blocks_read_them_once(tmp_path, monkeypatch, host_memory) -> None:
    shared = random_prompt(8 * BS, seed=14)
    a, b = shared + [1, 2, 3], shared + [4, 5]
    with make_engine(tmp_path, exact_hits=False, host_memory=host_memory, restore_policy="load") as eng:
        want = [eng.generate(p, GREEDY).token_ids for p in (a, b)]
        to_disk_only(eng)
        gate = DriveGate(monkeypatch)
        hold_deadlines(eng)
        gate.open.clear()
        outs = {}
        threads = [threading.Thread(target=lambda p=p, i=i: outs.update({i: eng.generate(p, GREEDY)}))
                   for i, p in enumerate((a, b))]
        for t in threads:
            t.start()
        assert gate.entered.wait(10)
        deadline = time.monotonic() + 10
        # Both requests are submitted (and, without a host tier, both planned) before any block
        # is read: the second must share the first's reads, not start its own.
        while time.monotonic() < deadline and eng.cache_status()["engine"]["waiting"] + \
                eng.cache_status()["engine"]["loading"] + eng.cache_status()["engine"]["running"] < 2:
            time.sleep(0.005)
        time.sleep(0.05)
        gate.open.set()
        for t in threads:
            t.join(30)
        eng.cache.audit()
    assert [outs[0].token_ids, outs[1].token_ids] == want
    assert len(gate.decode_threads) == 8, "each shared block is decoded once"
    for out in outs.values():
        assert sum(out.usage.hit_tokens_by_tier.values()) == 8 * BS


def test_at_most_max_loading_restores_and_requests_without_one_go_ahead(tmp_path, monkeypatch) -> None:
    prompts = [random_prompt(6 * BS + 1, seed=20 + i) for i in range(3)]
    fresh = random_prompt(3 * BS + 2, seed=30)
    with make_engine(tmp_path, exact_hits=False, host_memory="0", max_loading=1, restore_policy="load") as eng:
        want = [eng.generate(p, GREEDY).token_ids for p in prompts]
        to_disk_only(eng)
        gate = DriveGate(monkeypatch)
        hold_deadlines(eng)
        gate.open.clear()
        outs = {}
        threads = [threading.Thread(target=lambda p=p, i=i: outs.update({i: eng.generate(p, GREEDY)}))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        assert gate.entered.wait(10)
        most = 0
        for _ in range(20):
            most = max(most, eng.cache_status()["engine"]["loading"])
            time.sleep(0.005)
        # A request with nothing to load runs to the end while the loads are held.
        alone = eng.generate(fresh, GREEDY)
        assert not gate.open.is_set() and len(outs) == 0
        gate.open.set()
        for t in threads:
            t.join(30)
        eng.cache.audit()
    assert most == 1
    assert alone.usage.prompt_cache_miss_tokens == len(fresh)
    assert [outs[i].token_ids for i in range(3)] == want
    assert all(outs[i].usage.hit_tokens_by_tier["disk"] == 6 * BS for i in range(3))


def test_prefetch_at_submit_reads_a_queued_requests_blocks_into_host(tmp_path) -> None:
    queued = random_prompt(8 * BS + 3, seed=15)
    runner = random_prompt(2 * BS + 1, seed=16)
    with make_engine(tmp_path, exact_hits=False, max_seqs=1) as eng:
        first = eng.generate(queued, GREEDY)
        to_disk_only(eng)
        keys = list(eng.cache.match(block_keys(eng.namespace("default"), queued, BS,
                                               max_tokens=len(queued) - 1)).blocks)
        assert [t for _, t in keys] == ["disk"] * 8
        started = threading.Event()
        result = {}

        def run_long() -> None:
            for _ in eng.stream(runner, SamplingParams(max_tokens=400, ignore_eos=True)):
                started.set()

        long = threading.Thread(target=run_long)
        long.start()
        assert started.wait(10)
        waiter = threading.Thread(target=lambda: result.update(out=eng.generate(queued, GREEDY)))
        waiter.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(eng.cache.host.slot_of(k) is not None for k, _ in keys):
            time.sleep(0.005)
        in_host_while_queued = all(eng.cache.host.slot_of(k) is not None for k, _ in keys)
        still_queued = long.is_alive() and "out" not in result   # max_seqs=1: not admitted yet
        waiter.join(30)
        long.join(60)
    assert in_host_while_queued and still_queued
    out = result["out"]
    assert out.token_ids == first.token_ids
    # Its own prefetch moved them: billed as the disk hits they were when it arrived.
    assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 8 * BS, "remote": 0}


def test_a_sequence_finished_while_loading_gives_its_pages_back(tmp_path, monkeypatch) -> None:
    prompt = random_prompt(6 * BS + 2, seed=17)
    with make_engine(tmp_path, exact_hits=False, host_memory="0", restore_policy="load") as eng:
        eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        gate = DriveGate(monkeypatch)
        gate.open.clear()
        # A scheduler of its own over the engine's cache (the engine thread is idle and owns its
        # own scheduler; the cache is shared, as it is with HTTP threads).
        sched = Scheduler(eng.cache, max_batch_tokens=64)
        seq = Sequence(request_id="r", prompt_ids=prompt, params=GREEDY, tenant="default",
                       namespace=eng.namespace("default"), block_size=BS, max_len=len(prompt) + 6)
        sched.add(seq)
        assert sched.schedule() == [] and sched.loading == [seq]
        planned = list(seq.load.pages)
        assert [eng.cache.pool.refcount(p) for p in planned] == [2] * 6
        sched.finish(seq)                              # cancelled while its blocks are read
        assert not sched.has_work() and seq.pages == () and seq.load is None
        assert [eng.cache.pool.refcount(p) for p in planned] == [1] * 6   # only the fills hold them
        gate.open.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and eng.cache.pool.stats().in_use_pages:
            time.sleep(0.005)
        eng.cache.audit()
        assert eng.cache.pool.stats().in_use_pages == 0
        again = eng.generate(prompt, GREEDY)
    assert again.usage.hit_tokens_by_tier["device"] == 6 * BS    # the fills' blocks stayed cached
