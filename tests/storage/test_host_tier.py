import torch

from storage.host_tier import HostTier
from tests.storage.conftest import TINY, block_data, keys


def test_capacity_in_whole_blocks_and_lru_eviction_order():
    evicted = []
    host = HostTier(TINY, 3 * TINY.nbytes + 100,
                    on_evict=lambda k, slot: evicted.append((k.hash, host.slab[slot].clone())))
    assert host.num_slots == 3
    a, b, c, d = keys(4)
    for k in (a, b, c):
        host.slab[host.reserve(k)].copy_(block_data(k))
    host.touch(a)                               # order now b, c, a
    host.slab[host.reserve(d)].copy_(block_data(d))
    assert [h for h, _ in evicted] == [b.hash]
    assert torch.equal(evicted[0][1], block_data(b))   # evicted with its bytes intact
    assert host.hashes() == [c.hash, a.hash, d.hash]
    assert host.slot_of(b) is None
    assert torch.equal(host.slab[host.slot_of(d)], block_data(d))
    st = host.stats()
    assert (st.blocks, st.evictions, st.used_bytes, st.capacity_bytes) == (3, 1, 3 * TINY.nbytes, 3 * TINY.nbytes)
    host.audit()


def test_reserve_of_present_block_reuses_its_slot():
    host = HostTier(TINY, 2 * TINY.nbytes)
    (a,) = keys(1)
    s = host.reserve(a)
    assert host.reserve(a) == s and len(host) == 1
    host.audit()


def test_disabled_when_zero_bytes():
    host = HostTier(TINY, 0)
    assert not host.enabled and host.stats().capacity_bytes == 0


def test_not_pinned_without_cuda():
    assert HostTier(TINY, TINY.nbytes).pinned is torch.cuda.is_available()


def test_a_pinned_slot_is_never_evicted_reserved_or_freed():
    evicted = []
    host = HostTier(TINY, 2 * TINY.nbytes, on_evict=lambda k, slot: evicted.append(k.hash))
    a, b, c, d = keys(4)
    sa, sb = host.reserve(a), host.reserve(b)
    host.pin(sa)                                  # a fill reads a's slot (the LRU one)
    assert host.reservable() == 1
    sc = host.reserve(c)                          # evicts b, not the pinned LRU block a
    assert evicted == [b.hash] and sc == sb and host.slot_of(a) == sa
    host.pin(sc)
    assert host.reservable() == 0
    assert host.reserve(d) is None and not host.evict_lru()   # every slot is being read
    assert host.slot_of(d) is None and evicted == [b.hash]
    host.audit()
    assert host.remove(a.hash)                    # forgotten, but its slot stays out of use...
    assert host.slot_of(a) is None and host.reserve(d) is None
    host.audit()
    host.pin(sa)
    host.unpin(sa)
    assert host.reserve(d) is None                # ...until its last reader is done
    host.unpin(sa)
    assert host.reserve(d) == sa and host.reservable() == 1
    host.unpin(sc)
    assert host.reservable() == 2
    host.audit()
