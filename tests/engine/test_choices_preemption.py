"""Issue 29: n choices forked on one prompt's pages, under a device pool too small to hold them
all, so the scheduler preempts choices mid-decode (and re-admits them on their own cached
blocks). What a user relies on: every choice's tokens are those of the same request run in a
pool that never preempts; no choice fails (a shared page given back twice would fail one:
storage/device_pool.py raises on it); every page is back when the request ends, the pool's
bookkeeping sound; the prompt billed once."""
from __future__ import annotations

import pytest

from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams

PAGE = 2048          # bytes of one 4-token page of the tiny model's KV


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=28, n=4, ignore_eos=True),                                # greedy
    SamplingParams(max_tokens=28, n=4, ignore_eos=True, temperature=1.0, seed=4321),    # seeded draws
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("exact_hits", [True, False])
def test_preempted_choices_equal_an_unpreempted_run_and_give_every_page_back(tmp_path, params, exact_hits):
    ids = random_prompt(13, seed=71)       # 3 full pages and a partial one, shared by the 4 choices
    with make_engine(tmp_path / "roomy", device_memory="1MiB", exact_hits=exact_hits) as eng:
        expected = [o.token_ids for o in eng.generate(ids, params)]
        assert eng.scheduler.preemptions == 0
    # Each choice grows to 41 tokens (11 pages); the four need ~35 pages together, the pool has 16.
    with make_engine(tmp_path / "tight", device_memory=16 * PAGE, host_memory="256KiB",
                     exact_hits=exact_hits) as eng:
        pool = eng.cache.pool
        outs = eng.generate(ids, params)
        assert eng.scheduler.preemptions > 0          # the only request: every preemption took a choice
        assert [o.token_ids for o in outs] == expected
        assert [o.finish_reason for o in outs] == ["length"] * 4 and [o.index for o in outs] == [0, 1, 2, 3]
        u = outs[0].usage
        assert (u.prompt_tokens, u.completion_tokens, u.prompt_cache_miss_tokens) == (13, 4 * 28, 13)
        # Every page back: nothing referenced, the pool's books sound (no page lost, none twice free).
        assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
        assert pool.stats().in_use_pages == 0
        eng.cache.audit()
        # And the engine serves on: the same request again, now partly cached.
        assert [o.token_ids for o in eng.generate(ids, params)] == expected
        eng.cache.audit()
