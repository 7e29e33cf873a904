import pytest
import torch

from storage.device_pool import DevicePool
from tests.storage.conftest import TINY, keys


def test_allocates_free_pages_in_order_then_evicts_lru():
    evicted = []
    pool = DevicePool(TINY, 4, on_evict=lambda victims: evicted.append(victims))
    a, b, c, d = keys(4)
    assert pool.allocate(3) == [0, 1, 2]
    for page, k in zip([0, 1, 2], [a, b, c]):
        assert pool.register(page, k)
    # Release in order 1, 0, 2: LRU order is 1, 0, 2.
    for p in (1, 0, 2):
        pool.release(p)
    assert pool.evictable_pages() == [1, 0, 2]
    assert pool.allocate(1) == [3]            # a free page before any eviction
    assert evicted == []
    assert pool.allocate(2) == [1, 0]         # then LRU cached pages, in LRU order
    # One call for the allocation's victims (their copies out go as one batch), in LRU order.
    assert [[(k.hash, p) for k, p in batch] for batch in evicted] == [[(b.hash, 1), (a.hash, 0)]]
    assert pool.page_of(a) is None and pool.page_of(b) is None and pool.page_of(c) == 2
    pool.audit()


def test_refcounted_pages_are_never_evicted():
    pool = DevicePool(TINY, 2)
    a, b = keys(2)
    p = pool.allocate(2)
    pool.register(p[0], a)
    pool.register(p[1], b)
    pool.release(p[1])
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.allocate(1) == [p[1]]          # only the unreferenced page
    assert pool.page_of(a) == p[0]
    pool.audit()


def test_acquire_hit_makes_page_unevictable_and_touch_updates_lru():
    pool = DevicePool(TINY, 3)
    a, b, c = keys(3)
    pages = pool.allocate(3)
    for p, k in zip(pages, (a, b, c)):
        pool.register(p, k)
        pool.release(p)
    assert pool.evictable_pages() == [0, 1, 2]
    pool.acquire(pool.page_of(a))               # a hit on page 0
    assert pool.evictable_pages() == [1, 2]
    pool.release(0)                            # page 0 becomes most recently used
    assert pool.evictable_pages() == [1, 2, 0]
    assert pool.allocate(1) == [1]
    pool.audit()


def test_duplicate_register_keeps_first_page_and_frees_second():
    pool = DevicePool(TINY, 2)
    (a,) = keys(1)
    p0, p1 = pool.allocate(2)
    assert pool.register(p0, a) is True
    assert pool.register(p1, a) is False       # same block computed twice in one batch
    pool.release(p1)
    pool.release(p0)
    assert pool.page_of(a) == p0
    assert pool.stats().free_pages == 1 and pool.stats().cached_blocks == 1
    pool.audit()


def test_lookup_checks_tokens_not_only_the_hash():
    pool = DevicePool(TINY, 1)
    (a,) = keys(1)
    (p,) = pool.allocate(1)
    pool.register(p, a)
    forged = type(a)(a.hash, a.parent, tuple(t + 1 for t in a.token_ids), a.namespace)
    assert pool.page_of(forged) is None


def test_misuse_raises():
    pool = DevicePool(TINY, 2)
    with pytest.raises(RuntimeError):
        pool.release(0)
    with pytest.raises(RuntimeError):
        pool.acquire(0)
    (p,) = pool.allocate(1)
    pool.release(p)
    with pytest.raises(RuntimeError):
        pool.register(p, keys(1)[0])
    with pytest.raises(ValueError):
        DevicePool(TINY, 0)


def test_pool_tensor_shape_and_stats():
    pool = DevicePool(TINY, 5)
    assert pool.kv.shape == (5, 2, 2, 4, 2, 8)
    by_layer = DevicePool(TINY, 5, by_layer=True)     # the same view over [layer, page, ...] memory
    assert by_layer.kv.shape == (5, 2, 2, 4, 2, 8) and by_layer.kv.transpose(0, 1).is_contiguous()
    assert DevicePool.attention_span(TINY, 5, True) == by_layer.kv[:, 1].numel() == pool.kv.numel() // 2
    st = pool.stats()
    assert st.capacity_bytes == 5 * TINY.nbytes == 5 * 256 * 4
    assert st.used_bytes == 0 and st.free_pages == 5



def test_stats_count_pages_in_use_without_walking_them() -> None:
    # Issue 8, item 5: /metrics reads these on every scrape; in_use is derived (free + evictable
    # + in use == pages) and must agree with the refcounts after every transition.
    pool = DevicePool(TINY, 6)
    ks = keys(3)

    def in_use() -> int:
        return sum(1 for p in range(pool.num_pages) if pool.refcount(p) > 0)
    seen = []
    a = pool.allocate(3)
    for p, k in zip(a, ks):
        pool.register(p, k)
    for op in (lambda: pool.release(a[0]), lambda: pool.acquire(a[0]), lambda: pool.acquire(a[1]),
               lambda: pool.release(a[2]), lambda: pool.allocate(2), lambda: pool.release(a[1]),
               lambda: pool.release(a[1]), lambda: pool.evict([a[1]]), lambda: pool.release(a[0])):
        op()
        assert pool.stats().in_use_pages == in_use()
        seen.append(in_use())
    assert seen == [2, 3, 3, 2, 4, 4, 3, 3, 2]
    pool.audit()
