"""A request's hit account (storage/hit_account.py): facts in, the billed tier decided in one place,
the bill by tier out -- decided at the first admission only, less the loading blocks that were
computed instead; a forked choice carries the bill."""
from __future__ import annotations

from storage.hit_account import HitAccount
from tests.storage.conftest import keys


def test_a_block_its_own_prefetch_moved_up_is_billed_from_where_the_prefetch_read_it() -> None:
    a, b = keys(2)
    hits = HitAccount()
    hits.moved_up(a, "disk")
    assert hits.tier_of(a, "host") == "disk"       # in the host because of this request
    assert hits.tier_of(b, "host") == "host"       # someone else's: where it was found
    assert hits.tier_of(a, "device") == "device"   # on the device: a device hit, whoever moved it
    assert HitAccount().tier_of(a, "host") == "host"


def test_billed_once_at_the_first_admission_less_what_was_computed_instead() -> None:
    hits = HitAccount()
    assert not hits.billed and hits.by_tier is None
    hits.admitted(held=[("device", 4), ("host", 4)], recomputed=[("disk", 4)], loading=[("disk", 4), ("remote", 4)])
    assert hits.by_tier == {"device": 4, "host": 4, "disk": 8, "remote": 4}
    hits.late_load([("remote", 4)])                # a late probe's back load
    hits.computed_instead([("remote", 8)])         # the back blocks that did not arrive
    hits.admitted(held=[("device", 16)])           # re-admitted after a preemption: not billed again
    assert hits.billed and hits.by_tier == {"device": 4, "host": 4, "disk": 8, "remote": 0}
    child = hits.forked()
    assert child.by_tier == hits.by_tier and child.by_tier is not hits.by_tier
    assert HitAccount().forked().by_tier == {}      # forked before a bill: billed (as nothing) already
