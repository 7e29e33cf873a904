"""KV events are said by the tiers at their index's mutations (issue 32, item 2): the device pool
and the host slab, as the disk's index does. A real EventSink's queue is read after each mutation
of a real DevicePool and HostTier: one item per batch, "stored" when a block becomes findable
(readable, for a host slot: committed), "removed" when it stops being, nothing for a reserved
host block whose copy never landed. And, read with `ast`, no module that moves or places blocks
(storage/cascade.py, storage/loader.py, storage/tiered_cache.py) calls `events.stored` or
`events.removed` itself any more."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from storage.device_pool import DevicePool
from storage.host_tier import HostTier
from storage.kv_events.sink import EventSink
from tests.storage.conftest import TINY, keys

ROOT = Path(__file__).resolve().parents[2]
MOVERS = ["storage/cascade.py", "storage/loader.py", "storage/prefetch.py", "storage/tiered_cache.py"]


def drained(sink: EventSink) -> list[tuple]:
    out = []
    while not sink.queue.empty():
        item = sink.queue.get_nowait()
        out.append(item[:2] + (tuple(k if isinstance(k, bytes) else k.hash for k in item[2]),) if len(item) > 1 else item)
    return out


def _event_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"line {n.lineno}: events.{n.func.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("stored", "removed")
            and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "events"]


@pytest.mark.parametrize("module", MOVERS)
def test_the_movers_say_no_event_themselves(module: str) -> None:
    assert _event_calls(ROOT / module) == [], f"{module} says a tier's KV event; the tier's index says its own"


def test_the_check_sees_an_event_call(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(t, k):\n    t.events.stored([k], 'GPU')\n    self.t.events.removed([k], 'CPU')\n")
    assert len(_event_calls(src)) == 2


def test_the_device_pool_says_register_evict_and_drop() -> None:
    sink = EventSink()
    pool = DevicePool(TINY, 4, events=sink)
    ks = keys(6)
    h = [k.hash for k in ks]
    pages = pool.allocate(3)
    assert pool.register_many(list(zip(pages, ks[:3]))) == [True] * 3
    assert pool.register(pages[0], ks[0])          # again: nothing new, nothing said
    assert drained(sink) == [("stored", "GPU", tuple(h[:3]))]   # one batch, one event
    other = pool.allocate(1)[0]
    assert pool.register(other, ks[0]) is False    # another page caches it: nothing said
    assert pool.register(other, ks[3])
    for p in (*pages, other):
        pool.release(p)
    assert drained(sink) == [("stored", "GPU", (h[3],))]
    pool.allocate(2)                               # evicts the two LRU blocks: one event
    assert drained(sink) == [("removed", "GPU", (h[0], h[1]))]
    pool.drop(pool.evictable_pages())
    assert drained(sink) == [("removed", "GPU", (h[2], h[3]))]
    pool.audit()


def test_an_eviction_is_said_after_on_evict_returned() -> None:
    sink = EventSink()
    seen = []
    pool = DevicePool(TINY, 1, events=sink, on_evict=lambda victims: seen.append(drained(sink)))
    (a,) = keys(1)
    page = pool.allocate(1)[0]
    pool.register(page, a)
    pool.release(page)
    drained(sink)
    pool.allocate(1)
    assert seen == [[]] and drained(sink) == [("removed", "GPU", (a.hash,))]


def test_the_host_tier_says_commit_evict_and_remove_and_never_an_unlanded_block() -> None:
    sink = EventSink()
    host = HostTier(TINY, 3 * TINY.nbytes, events=sink)
    a, b, c, d, e = keys(5)
    slots = [host.reserve(k) for k in (a, b)]
    assert drained(sink) == []                     # reserved: findable, not readable yet
    assert host.commit(slots) == [a, b]
    assert host.commit(slots) == []                # committed once
    assert drained(sink) == [("stored", "CPU", (a.hash, b.hash))]
    # A reserved block whose copy failed is removed unsaid: no BlockStored, no BlockRemoved.
    failed = host.reserve(c)
    assert host.remove(c.hash)
    assert host.commit([failed]) == [] and drained(sink) == []
    host.commit([host.reserve(c)])
    host.commit([host.reserve(d)])                 # full: evicts a (LRU)
    assert drained(sink) == [("stored", "CPU", (c.hash,)), ("removed", "CPU", (a.hash,)), ("stored", "CPU", (d.hash,))]
    # A block removed while its copy ran (its slot pinned) is not said when the copy lands.
    s = host.reserve(e)                            # evicts b
    host.pin(s)
    assert host.remove_many([e.hash, c.hash, d.hash]) == 3
    assert host.commit([s]) == []
    host.unpin(s)
    assert drained(sink) == [("removed", "CPU", (b.hash,)), ("removed", "CPU", (c.hash, d.hash))]
    host.audit()
