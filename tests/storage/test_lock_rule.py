"""Issue 30, item 3: the tiers' lock is never held across a device wait or a block copy, so an
HTTP thread's flush or demote never blocks an engine step.

The cache runs with Transfer(deferred=True) (device -> host copies complete later, as on a CUDA
stream), and one copy into a host slot is held: its completion is a Future that says when a
thread starts waiting for it and completes only when the test lets it. A flush (and a demote of
the host tier) must wait for it -- it reads that slot -- and while it waits, a whole engine step
(allocate with evictions into the host tier, write, register, match, release) completes on
another thread. The old flush waited for every pending copy under the lock, so the step hung
until the copy was let go. Events and joins with generous deadlines, never timings.
Real LMDB and zstd under tmp_path.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import same_bits
from tests.storage.test_transfer_protocol import compute, deferred_cache


class HeldCopy(Future):
    """A copy into a host slot that lands when the test says: `waited` is set once a thread
    waits for it; the bytes are written (then the Future completes) once `gate` is set."""

    def __init__(self, slot_view, block) -> None:
        super().__init__()
        self.waited, self.gate = threading.Event(), threading.Event()
        self._dst, self._src = slot_view, block.clone()

    def result(self, timeout=None):
        self.waited.set()
        assert self.gate.wait(60), "the test never let the held copy land"
        if not self.done():
            self._dst.copy_(self._src)
            self.set_result(None)
        return super().result(timeout)

    def let_go(self) -> None:
        self.gate.set()


def hold_copy_into(cache, key) -> HeldCopy:
    """The copy into `key`'s host slot made pending again, held (the slot's bytes are stale until
    it lands)."""
    with cache.tiers.lock:
        slot = cache.host.slot_of(key)
        cache.transfer.wait_host(slot)
        held = HeldCopy(cache.host.slab[slot], cache.host.slab[slot])
        cache.host.slab[slot].zero_()                 # what the slot holds before the copy lands
        cache.transfer._host_pending[slot] = held
    return held


def engine_step(cache, ks, done: threading.Event, errors: list) -> None:
    """What the engine thread does in a step, evictions into the host tier included."""
    try:
        compute(cache, ks)
        cache.match(ks)
        done.set()
    except BaseException as e:      # surfaced by the test
        errors.append(e)


@pytest.mark.parametrize("move", ["flush", "demote_host"])
def test_a_flush_waiting_for_a_device_copy_never_blocks_a_step(tmp_path, move) -> None:
    ks = keys(12)
    cache = deferred_cache(tmp_path / "disk", pages=4, host_slots=6)
    try:
        compute(cache, ks[:4])
        cache.demote("device")                        # k0..k3 in host slots only
        held = hold_copy_into(cache, ks[0])
        result: dict = {}
        op = threading.Thread(target=lambda: result.update(r=cache.flush() if move == "flush"
                                                           else cache.demote("host")))
        op.start()
        assert held.waited.wait(60), "the flush never waited for the slot's copy"
        done, errors = threading.Event(), []
        step = threading.Thread(target=engine_step, args=(cache, ks[4:8], done, errors))
        step.start()
        try:
            # NOTE: the flush is parked in its wait for the held copy right now.
            assert done.wait(60), "an engine step waited for the flush's device copy"
            assert not errors, errors
            assert op.is_alive() and not held.done()
        finally:
            held.let_go()
            op.join(60)
            step.join(60)
        assert not op.is_alive()
        assert cache.disk.drain(timeout=30)
        got = cache.disk.get(ks[0])                  # the flush stored the copy's bytes, not the stale slot
        assert got is not None and same_bits(got.view(TINY.shape), block_data(ks[0]))
        if move == "flush":
            assert result["r"].complete
            for k in ks[:4]:      # the flush's blocks (the step's came after its start)
                got = cache.disk.get(k)
                assert got is not None and same_bits(got.view(TINY.shape), block_data(k)), k
        cache.audit()
    finally:
        cache.close()


def test_a_flush_never_keeps_a_page_copied_while_it_was_reused(tmp_path) -> None:
    """The flush copies device pages with no lock held and no reference on them (the engine's
    check-then-allocate must never find a page gone): a page evicted and rewritten meanwhile is
    noticed by its generation, the torn copy thrown away, and the block taken from the host slot
    its eviction put it in."""
    from storage import cascade as cascade_module
    ks = keys(8)
    cache = deferred_cache(tmp_path / "disk", pages=4, host_slots=8)
    real = cascade_module.Cascade._copy_pages_out
    reused: list[int] = []

    def copy_then_reuse(self, pages):
        out = real(self, pages)
        if not reused:            # once: between the copy and its check, the engine reuses them all
            compute(cache, ks[4:8])
            reused.append(len(pages))
        return out
    try:
        compute(cache, ks[:4])
        cascade_module.Cascade._copy_pages_out = copy_then_reuse
        assert cache.flush().complete
        assert reused == [4]
        for k in ks[:4]:      # the flush's blocks (the step's came after its start: not its to push)
            got = cache.disk.get(k)
            assert got is not None and same_bits(got.view(TINY.shape), block_data(k)), k
        cache.audit()
    finally:
        cascade_module.Cascade._copy_pages_out = real
        cache.close()


def test_a_cache_closed_under_a_running_step_leaves_its_host_memory_mapped(tmp_path) -> None:
    """Engine.close past its deadline with the step still running closes the cache with
    release_memory=False: the slab a queued copy may still write stays mapped and intact."""
    ks = keys(4)
    cache = deferred_cache(tmp_path / "disk", pages=4, host_slots=4)
    compute(cache, ks)
    cache.demote("device")
    slab = cache.host.slab
    cache.close(release_memory=False)
    assert cache.host.slab is slab and slab.numel() > 0
    with cache.tiers.lock:
        slots = [cache.host.slot_of(k) for k in ks]
    for slot, k in zip(slots, ks):                  # still readable memory, still the blocks
        assert same_bits(slab[slot], block_data(k))
    slab[slots[0]].copy_(block_data(ks[1]))         # and writable: nothing was unmapped
