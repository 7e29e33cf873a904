"""Issue 27, item 1: a deadline on every load -- a stalled store costs a recompute, never a wait.

A real tiny engine over a real LMDB disk tier (and a real valkey for the remote case). The stall
is real too, injected as tests/engine/test_storage_faults.py injects its fault: the disk tier's
LMDB environment is wrapped so that reading chosen blocks waits "at the drive" on an Event the
test sets (every byte still comes from LMDB through the real codec); the remote tier's reads wait
on an Event before the real MGETs. Time is the scheduler's injected clock: frozen while a load is
planned, moved past its deadline by the test. No wall-clock bound: waits are hang guards only.

Where a test must see that a late block never lands in a computed page, the disk holds "marked"
blocks under the prompt's keys (noise, stored through the real tier and verified when read): a
page holding one differs from anything the model computes.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.load_deadline import LOAD_MARGIN, LoadDeadlines
from engine.model import model_from_config
from storage.config import CacheConfig
from storage.hashing import block_keys
from storage.remote.breaker import BreakerConfig
from tests.engine.conftest import random_prompt, reference_greedy, tiny_llama_config
from tests.engine.test_async_restore import to_disk_only
from tests.engine.test_compute_or_load import force_figures
from tieredkv import Engine, SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6)
GUARD_S = 60          # hang guards only


class Clock:
    """The scheduler's clock: stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StalledDrive:
    """The disk tier's LMDB environment, whose reads of chosen blocks wait until released."""

    def __init__(self, env) -> None:
        self._env = env
        self.stalls: dict[bytes, threading.Event] = {}
        self.reached = threading.Event()        # a stalled block's read is waiting

    def stall(self, keys) -> threading.Event:
        release = threading.Event()
        for k in keys:
            self.stalls[k.hash] = release
        return release

    def begin(self, *args, write: bool = False, **kw):
        txn = self._env.begin(*args, write=write, **kw)
        return txn if write else _StalledTxn(txn, self)

    def __getattr__(self, name: str):
        return getattr(self._env, name)


class _StalledTxn:
    def __init__(self, txn, drive: StalledDrive) -> None:
        self._txn, self._drive = txn, drive

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, *exc):
        return self._txn.__exit__(*exc)

    def get(self, key, default=None, db=None):
        release = self._drive.stalls.get(bytes(key))
        if release is not None and not release.is_set():
            self._drive.reached.set()
            release.wait(GUARD_S)
        return self._txn.get(key, default, db=db)

    def __getattr__(self, name: str):
        return getattr(self._txn, name)


def engine(tmp_path, **kw) -> Engine:
    kw = {"restore_policy": "load", "disk_dir": str(tmp_path / "kv"), **kw}
    cache = CacheConfig(block_size=BS, device_memory="256KiB", host_memory="256KiB", disk_capacity="64MiB", **kw)
    return Engine(model_from_config(tiny_llama_config(), seed=0), cache, exact_hits=False)   # prefix loads only


def stall_method(obj, name: str) -> tuple[threading.Event, threading.Event]:
    """`obj.name` (a real store call) waits, once called, until the first event is set; the
    second says it was reached."""
    release, reached = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def stalled(*args, **kw):
        reached.set()
        release.wait(GUARD_S)
        return real(*args, **kw)
    setattr(obj, name, stalled)
    return release, reached


def stall_disk(eng) -> StalledDrive:
    drive = StalledDrive(eng.cache.disk._gate._env)      # every transaction of the tier begins here
    eng.cache.disk._gate._env = drive
    return drive


def keys_of(eng, prompt, tenant: str = "default"):
    return block_keys(eng.namespace(tenant), prompt, BS, max_tokens=len(prompt) - 1)


def mark_on_disk(eng, keys) -> torch.Tensor:
    """Store a marked block (noise) under each key; returns the mark."""
    mark = torch.randn(eng.layout.shape, generator=torch.Generator().manual_seed(7)).to(eng.layout.dtype)
    for k in keys:
        assert eng.cache.disk.put(k, mark, wait=True)
    assert eng.cache.disk.drain()
    return mark


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.002)


def in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    t.start()
    return t, out


def drained(eng) -> bool:
    """Every fill ended and every page came back."""
    with eng.cache.tiers.lock:
        return not eng.cache.loader.inflight and eng.cache.pool.stats().in_use_pages == 0


def loading(eng, n: int = 1) -> bool:
    return len(eng.scheduler.loading) >= n


def check_usage(out, prompt, hits_by_tier: dict[str, int]) -> None:
    u = out.usage
    assert u.hit_tokens_by_tier == {**dict.fromkeys(("device", "host", "disk", "remote"), 0), **hits_by_tier}
    assert u.prompt_cache_hit_tokens + u.prompt_cache_miss_tokens == u.prompt_tokens == len(prompt)


def test_the_deadline_is_the_predicted_recompute_with_a_margin() -> None:
    predicted = {(2, 6): 0.4}
    rule = LoadDeadlines(lambda start, end: predicted.get((start, end)), margin=1.5, slack_s=0.05, fallback_s=2.0)
    assert rule.seconds(2, 6) == pytest.approx(1.5 * 0.4 + 0.05)
    assert rule.seconds(0, 6) == pytest.approx(1.5 * 2.0 + 0.05)     # no prefill figure yet: the fallback
    for bad in ({"margin": 0.9}, {"slack_s": -1.0}, {"fallback_s": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoadDeadlines(lambda s, e: None, **bad)


def test_a_load_far_slower_than_its_tiers_figures_is_given_up_before_the_recompute() -> None:
    # The recompute of blocks [0, 8) is predicted at 2 s; their load from the remote at 0.1 s. A
    # load running 3x its figure is a sick store, not a slow load: it is given up at 0.3 s, not 2.5.
    rule = LoadDeadlines(lambda start, end: 2.0, margin=1.25, slack_s=0.05,
                         load_seconds=lambda tiers: 0.1 if "remote" in tiers else None)
    assert rule.seconds(0, 8, ["remote"] * 8) == pytest.approx(LOAD_MARGIN * 0.1 + 0.05)
    assert rule.seconds(0, 8, ["disk"] * 8) == pytest.approx(1.25 * 2.0 + 0.05)    # local: the compute alone
    assert rule.seconds(0, 8, ["disk"] * 4 + ["remote"] * 4) == pytest.approx(LOAD_MARGIN * 0.1 + 0.05)
    no_figure = LoadDeadlines(lambda start, end: 2.0, margin=1.25, slack_s=0.05, load_seconds=lambda tiers: None)
    assert no_figure.seconds(0, 8, ["remote"] * 8) == pytest.approx(1.25 * 2.0 + 0.05)   # no figure: the compute
    assert rule.seconds(0, 8, ["device"] * 8) == pytest.approx(1.25 * 2.0 + 0.05)  # nothing loads
    slow_link = LoadDeadlines(lambda start, end: 0.2, load_seconds=lambda tiers: 5.0)
    assert slow_link.seconds(0, 8, ["remote"]) == pytest.approx(1.25 * 0.2 + 0.1)   # never past the compute


def test_a_load_past_its_deadline_is_abandoned_and_computed(tmp_path) -> None:
    prompt = random_prompt(8 * BS + 3, seed=41)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with engine(tmp_path) as eng:
        keys = keys_of(eng, prompt)
        mark_on_disk(eng, keys)
        drive = stall_disk(eng)
        release = drive.stall(keys)
        eng.scheduler.clock = clock = Clock()
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY))
            wait_until(lambda: loading(eng) and drive.reached.is_set(), "the load reached the stalled drive")
            assert "result" not in got                  # waiting for its load, before its deadline
            clock.now += 3600.0                         # past any deadline
            t.join(GUARD_S)
            finished_while_stalled = "result" in got and not release.is_set()
            status = eng.cache_status()
        finally:
            release.set()
        wait_until(lambda: drained(eng), "the late fills end and give their pages back")
        eng.cache.audit()
    assert finished_while_stalled
    out = got["result"]
    assert out.token_ids == expected                    # computed, not the marked blocks
    check_usage(out, prompt, {})                        # the abandoned blocks are billed as computed
    assert out.usage.prompt_cache_miss_tokens == len(prompt)
    disk = status["tiers"]["disk"]
    assert (disk["abandoned"], disk["abandoned_loads"], disk["hit_tokens"]) == (8, 1, 0)
    assert status["cost_model"]["load_deadline"]["margin"] == eng.config.load_deadline_margin


def test_a_late_block_never_lands_in_a_page_the_sequence_computed(tmp_path) -> None:
    prompt = random_prompt(8 * BS + 3, seed=42)
    with engine(tmp_path / "cold", disk_dir=None) as cold:        # the cold run's KV, block by block
        cold.generate(prompt, GREEDY)
        cold_kv = [cold.cache.pool.kv[cold.cache.pool.page_of(k)].clone() for k in keys_of(cold, prompt)]
    with engine(tmp_path) as eng:
        keys = keys_of(eng, prompt)
        mark = mark_on_disk(eng, keys)
        drive = stall_disk(eng)
        release = drive.stall(keys)
        eng.scheduler.clock = clock = Clock()
        first = threading.Event()
        chunks: list = []

        def run() -> list:
            for c in eng.stream(prompt, SamplingParams(max_tokens=300, ignore_eos=True)):
                chunks.append(c)
                first.set()
            return chunks
        try:
            t, _ = in_background(run)
            wait_until(lambda: loading(eng) and drive.reached.is_set(), "the load reached the stalled drive")
            planned = list(eng.scheduler.loading[0].load.pages)     # the fills' pages
            clock.now += 3600.0
            assert first.wait(GUARD_S), "the sequence still waits for its stalled load"
            seq = next(s for s in list(eng.scheduler.running) if s.prompt_ids == prompt)
            computed = list(seq.pages[:len(keys)])
            assert not set(computed) & set(planned)       # it computes into fresh pages
            release.set()                                 # the late blocks arrive now, mid-decode
            wait_until(lambda: not eng.cache.loader.inflight, "the late fills end")
            still_running = t.is_alive()
            kv_after = [eng.cache.pool.kv[p].clone() for p in computed]
            found = [eng.cache.pool.page_of(k) for k in keys]
        finally:
            release.set()
        t.join(GUARD_S)
        wait_until(lambda: drained(eng), "every page comes back")
        again = eng.generate(prompt, GREEDY)              # what the cache now holds for the prompt
        eng.cache.audit()
    assert still_running                                  # the fills ended while it decoded
    for got, want in zip(kv_after, cold_kv):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(got, mark)
    assert found == computed                              # the late blocks were dropped, not registered
    assert again.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    assert again.usage.hit_tokens_by_tier["device"] == len(keys) * BS


def test_a_partly_arrived_load_keeps_what_arrived_and_computes_the_rest(tmp_path) -> None:
    """B's prompt extends A's: B shares A's fills for its first 4 blocks and loads 4 more of its
    own. A's blocks arrive, B's own stay stalled: past its deadline B keeps the 4 that arrived
    (hits) and computes the rest (misses)."""
    shared = random_prompt(4 * BS, seed=43)
    a_prompt = shared + random_prompt(3, seed=44)
    b_prompt = shared + random_prompt(4 * BS + 2, seed=45)
    with engine(tmp_path) as eng:
        eng.generate(b_prompt, GREEDY)
        to_disk_only(eng)
        keys = keys_of(eng, b_prompt)
        drive = stall_disk(eng)
        release_a, release_b = drive.stall(keys[:4]), drive.stall(keys[4:])
        eng.scheduler.clock = clock = Clock()
        try:
            ta, a = in_background(lambda: eng.generate(a_prompt, GREEDY))
            wait_until(lambda: loading(eng, 1), "A is loading")
            tb, b = in_background(lambda: eng.generate(b_prompt, GREEDY))
            wait_until(lambda: loading(eng, 2), "B is loading")
            la, lb = (s.load for s in eng.scheduler.loading)
            shares = la.fills[:4] == lb.fills[:4] and la.pages == lb.pages[:4]
            release_a.set()
            ta.join(GUARD_S)
            b_waited = "result" not in b                  # its own blocks are still stalled
            clock.now += 3600.0
            tb.join(GUARD_S)
            b_done_while_stalled = "result" in b and not release_b.is_set()
            disk = eng.cache.stats()["disk"]
        finally:
            release_a.set()
            release_b.set()
        wait_until(lambda: drained(eng), "every page comes back")
        eng.cache.audit()
    assert shares and b_waited and b_done_while_stalled
    assert a["result"].token_ids == reference_greedy(None, a_prompt, GREEDY.max_tokens)
    check_usage(a["result"], a_prompt, {"disk": 4 * BS})
    assert b["result"].token_ids == reference_greedy(None, b_prompt, GREEDY.max_tokens)
    check_usage(b["result"], b_prompt, {"disk": 4 * BS})       # the arrived ones, and only those
    assert b["result"].usage.prompt_cache_miss_tokens == len(b_prompt) - 4 * BS
    assert (disk.abandoned, disk.abandoned_loads) == (4, 1)


def test_a_split_plans_back_past_its_deadline_is_computed_after_its_front(tmp_path) -> None:
    prompt = random_prompt(15 * BS + 3, seed=46)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with engine(tmp_path, restore_policy="auto") as eng:
        eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        force_figures(eng, block_s=1.0, token_s=0.25)   # split at 7 of 15 (test_compute_or_load)
        keys = keys_of(eng, prompt)
        drive = stall_disk(eng)
        release = drive.stall(keys[7:])
        eng.scheduler.clock = clock = Clock()
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY))
            wait_until(lambda: any(s.load is not None and s.num_computed == s.compute_until == 7 * BS
                                   for s in list(eng.scheduler.running)), "the front computed, the back loading")
            assert "result" not in got
            clock.now += 3600.0
            t.join(GUARD_S)
            done_while_stalled = "result" in got and not release.is_set()
            disk = eng.cache.stats()["disk"]
        finally:
            release.set()
        wait_until(lambda: drained(eng), "every page comes back")
        eng.cache.audit()
    assert done_while_stalled
    out = got["result"]
    assert out.token_ids == expected
    # The front was the cache's (recomputed by choice: hits); the back did not arrive: computed.
    check_usage(out, prompt, {"disk": 7 * BS})
    assert out.metrics.recomputed_hit_tokens == 7 * BS
    assert (disk.abandoned, disk.abandoned_loads) == (8, 1)


def test_a_stalled_remote_read_is_abandoned_and_its_breaker_learns(tmp_path, valkey) -> None:
    """Blocks 0-3 on the local disk, 4-7 only in the shared store, whose reads stall: the disk
    part arrives and is kept, the remote part is computed, and the breaker counts the stall."""
    tenant = "deadline-remote"          # the session's store is shared: a namespace of our own
    prompt = random_prompt(8 * BS + 1, seed=47)
    with engine(tmp_path / "cold", disk_dir=None) as cold:
        cold.generate(prompt, GREEDY, tenant=tenant)
        blocks = [cold.cache.pool.kv[cold.cache.pool.page_of(k)].clone() for k in keys_of(cold, prompt, tenant)]
    with engine(tmp_path, remote_url=valkey.url, remote_timeout_s=GUARD_S) as eng:
        keys = keys_of(eng, prompt, tenant)
        for k, block in zip(keys[:4], blocks[:4]):
            assert eng.cache.disk.put(k, block, wait=True)
        for k, block in zip(keys[4:], blocks[4:]):
            assert eng.cache.remote.put(k, block, wait=True)
        assert eng.cache.disk.drain() and eng.cache.remote.drain()
        remote = eng.cache.remote
        remote.breaker.config = BreakerConfig(failures_to_open=1, cooldown_s=3600)
        release, reached = stall_method(remote, "get_many")
        eng.scheduler.clock = clock = Clock()
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant=tenant))
            wait_until(lambda: loading(eng) and reached.is_set(), "the remote read is stalled")
            wait_until(lambda: all(f is None or f.done.is_set() for f in eng.scheduler.loading[0].load.fills[:4]),
                       "the disk part arrived")
            clock.now += 3600.0
            t.join(GUARD_S)
            done_while_stalled = "result" in got and not release.is_set()
            status = eng.cache_status()["tiers"]
        finally:
            release.set()
        wait_until(lambda: drained(eng), "every page comes back")
        eng.cache.audit()
    assert done_while_stalled
    out = got["result"]
    assert out.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    check_usage(out, prompt, {"disk": 4 * BS})
    assert (status["remote"]["abandoned"], status["remote"]["abandoned_loads"]) == (4, 1)
    assert status["disk"]["abandoned"] == 0
    assert status["remote"]["breaker"] == "open" and status["remote"]["breaker_opened"] == 1


def test_a_request_stops_waiting_for_a_stalled_remote_probe_and_computes(tmp_path, valkey) -> None:
    """The shared store holds the prompt, but its probe (which blocks it holds, asked at submit)
    stalls: past the probe's deadline the request is admitted as if the store held nothing,
    computes every token (billed as computed: nothing was served), and the tokens are a cold run's."""
    tenant = "deadline-probe"
    prompt = random_prompt(8 * BS + 1, seed=53)
    with engine(tmp_path / "cold", disk_dir=None) as cold:
        cold.generate(prompt, GREEDY, tenant=tenant)
        blocks = [cold.cache.pool.kv[cold.cache.pool.page_of(k)].clone() for k in keys_of(cold, prompt, tenant)]
    with engine(tmp_path, disk_dir=None, remote_url=valkey.url, remote_timeout_s=GUARD_S) as eng:
        keys = keys_of(eng, prompt, tenant)
        for k, block in zip(keys, blocks):
            assert eng.cache.remote.put(k, block, wait=True)
        assert eng.cache.remote.drain()
        remote = eng.cache.remote
        release, reached = stall_method(remote, "probe")
        eng.scheduler.clock = clock = Clock()
        try:
            t, got = in_background(lambda: eng.generate(prompt, GREEDY, tenant=tenant))
            wait_until(lambda: reached.is_set() and eng.scheduler.waiting, "the probe is stalled")
            wait_until(lambda: eng.scheduler.waiting[0].probe_deadline is not None, "its first turn")
            assert "result" not in got and eng.scheduler.probes.abandoned == 0   # waits while in time
            clock.now += 3600.0
            t.join(GUARD_S)
            done_while_stalled = "result" in got and not release.is_set()
        finally:
            release.set()
        wait_until(lambda: drained(eng), "every page comes back")
        abandoned = eng.scheduler.probes.abandoned
    assert done_while_stalled and abandoned == 1
    out = got["result"]
    assert out.token_ids == reference_greedy(None, prompt, GREEDY.max_tokens)
    check_usage(out, prompt, {})
