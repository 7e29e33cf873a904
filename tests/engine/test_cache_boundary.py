"""The scheduler meets the cache at one boundary (issue 43, item 3; storage/kv_blocks.py): one
admission is one `plan` call and one `finish` call into the cache, the engine never handles a
raw page verb (start_load, allocate, register, release...), and a Sequence holds no page list it
could change. Counted on a real TieredKVCache (its class swapped for a subclass that counts the
calls made from outside it, nothing else changed), with a prompt whose blocks are held by the
host tier, the disk tier and nowhere: its greedy tokens and its bill are the ones computing it
gives and the tiers that held it."""
from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import Counter

import pytest

from engine.sequence import Sequence
from storage.tiered_cache import TieredKVCache
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

B = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# What an engine may no longer ask of the cache about a request's pages: the verbs under the boundary.
PAGE_VERBS = {"start_load", "finish_load", "cancel_load", "load_now", "recomputed", "allocate", "register",
              "release", "share", "is_shared", "copy_on_write", "match"}


def count_calls(cache: TieredKVCache) -> Counter:
    """Every public method of `cache` counted when called from outside the cache (a call the cache
    makes to itself is not counted). The object and its behaviour are the same."""
    calls: Counter = Counter()
    local = threading.local()

    def wrap(name, fn):
        def counted(self, *args, **kw):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                calls[name] += 1
            local.depth = depth + 1
            try:
                return fn(self, *args, **kw)
            finally:
                local.depth = depth
        return counted

    methods = {name: wrap(name, member) for name, member in inspect.getmembers(TieredKVCache, inspect.isfunction)
               if not name.startswith("_")}
    cache.__class__ = type("CountingCache", (TieredKVCache,), methods)
    return calls


def test_one_admission_is_one_plan_and_one_finish_with_hits_from_host_disk_and_a_miss(tmp_path) -> None:
    a, b = random_prompt(4 * B, seed=1), random_prompt(4 * B, seed=2)
    ids = a + b + random_prompt(7, seed=3)          # a: host, b: disk, the rest: computed
    with make_engine(tmp_path / "ref", disk=False) as ref:
        expected = ref.generate(ids, GREEDY).token_ids
    with make_engine(tmp_path, restore_policy="load", exact_hits=False) as eng:
        cache = eng.cache
        eng.generate(a + b + [5], SamplingParams(max_tokens=1))      # a and b computed...
        cache.demote("device")
        cache.demote("host")
        cache.disk.drain()                                            # ...and on the disk only
        eng.generate(a + [5], SamplingParams(max_tokens=1))          # a back up...
        cache.demote("device")                                        # ...and in the host tier
        calls = count_calls(cache)
        out = eng.generate(ids, GREEDY)
        assert out.token_ids == expected
        assert out.usage.hit_tokens_by_tier == {"device": 0, "host": 4 * B, "disk": 4 * B, "remote": 0}
        assert out.usage.prompt_cache_miss_tokens == len(ids) - 8 * B
        assert calls["plan"] == 1 and calls["finish"] == 1, dict(calls)
        assert calls["computed"] >= 1 and calls["grow"] >= 1, dict(calls)   # its blocks registered, its pages grown
        assert not PAGE_VERBS & set(calls), dict(calls)
        cache.audit()


def test_a_sequence_holds_no_page_list_it_could_change() -> None:
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert not names & {"pages", "logits_pages", "load", "registered"}
    seq = Sequence(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams(), tenant="t",
                   namespace=b"\0" * 32, block_size=B, max_len=8)
    assert seq.pages == () and isinstance(seq.pages, tuple) and seq.logits_pages == ()
    with pytest.raises(AttributeError):
        seq.pages = [1, 2]
