"""Issue 7, item 2: a disk tier that cannot be read costs a recompute, never a request.

A real tiny engine with a real LMDB disk tier. The fault is real too: every read transaction
the disk tier opens fails with LMDB's own ReadersFullError (what a reader table full of dead
processes' slots gives); writes keep working. Requests needing disk blocks must still finish
with the same greedy tokens, an unrelated request running meanwhile must be untouched, and
every device page must come back.
"""
from __future__ import annotations

import lmdb

from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams


class _ReadsFail:
    """The tier's LMDB environment, whose read transactions fail as a full reader table does."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def begin(self, *args, write: bool = False, **kw):
        if not write:
            raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL: Environment maxreaders limit reached")
        return self._env.begin(*args, write=write, **kw)

    def __getattr__(self, name: str):
        return getattr(self._env, name)


def test_unreadable_disk_is_a_counted_miss_and_fails_no_request(tmp_path) -> None:
    prompt = random_prompt(8 * 4 + 3, seed=5)
    other = random_prompt(6 * 4 + 1, seed=6)
    greedy = SamplingParams(max_tokens=6)
    with make_engine(tmp_path, restore_policy="load", exact_hits=False) as eng:     # the hit is read, not recomputed
        first = eng.generate(prompt, greedy)
        eng.cache.demote("device")
        eng.cache.demote("host")
        eng.cache.disk.drain()
        assert eng.lookup(prompt).hit_tokens_by_tier["disk"] == 32
        total_pages = eng.cache.pool.num_pages
        healthy_env = eng.cache.disk._gate._env             # every transaction of the tier begins here
        eng.cache.disk._gate._env = _ReadsFail(healthy_env)
        try:
            running = eng.stream(other, SamplingParams(max_tokens=40))
            next(iter(running))                       # the unrelated request is decoding
            again = eng.generate(prompt, greedy)
            rest = list(running)
        finally:
            eng.cache.disk._gate._env = healthy_env
        assert again.token_ids == first.token_ids
        assert again.usage.hit_tokens_by_tier["disk"] == 0
        assert again.usage.prompt_cache_hit_tokens + again.usage.prompt_cache_miss_tokens == len(prompt)
        assert rest[-1].finish_reason == "length"
        assert eng.cache.disk.stats().read_errors > 0
        assert eng.cache.pool.num_free == total_pages     # every page came back
        eng.cache.audit()
