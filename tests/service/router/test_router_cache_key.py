"""Issue 39, item 3 -- OpenAI's `prompt_cache_key` behind `tieredkv route`: a key's requests stay on
one backend while it is in rotation, even when their prompts share nothing (so the prefix index
has nothing to go on); other keys spread; a key whose backend is ejected is let go; the router's
log line names the key.

A real router in front of two real tiny-engine servers on loopback (one behind a FaultFront).
"""
from __future__ import annotations

import logging

import pytest

from service.router.proxy import BACKEND_HEADER
from tests.service.conftest import ServerThread
from tests.service.router.harness import RouterThread, complete, events_kw, wait_for
from tests.service.tiny_engine import build_engine
from tools.fault_front import FaultFront

FAST = {"eject_cooldown_s": 0.2, "eject_cooldown_max_s": 1.0, "health_interval_s": 0.2}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("cache_key")
    with ServerThread(build_engine(tmp / "a", tokenizer, **events_kw())) as a, \
            ServerThread(build_engine(tmp / "b", tokenizer, **events_kw())) as b:
        yield a, b


def landed(c, key: str | None, prompt: str, user: str = "acme") -> str:
    extra = {} if key is None else {"prompt_cache_key": key}
    r = complete(c, prompt, user=user, **extra)
    assert r.status_code == 200, r.text
    return r.headers[BACKEND_HEADER]


def test_a_keys_requests_stay_on_one_backend_whatever_their_prompts(pair, caplog) -> None:
    a, b = pair
    caplog.set_level(logging.INFO, logger="tieredkv.router.requests")
    with RouterThread(a.url, b.url) as r, r.client() as c:
        assert r.health()["backends_up"] == 2
        # Without a key, prompts that share nothing spread over both (the fewest routed wins a tie).
        assert len({landed(c, None, f"unkeyed prompt number {i}, all different {i * 7}") for i in range(6)}) == 2
        first = {landed(c, "conv-1", f"{i} keyed prompt with nothing in common #{i * 13}") for i in range(8)}
        assert len(first) == 1, first
        # A second key is routed afresh: the tie goes to the backend the first key did not load.
        second = {landed(c, "conv-2", f"{i} other key, other words ~{i * 17}") for i in range(8)}
        assert len(second) == 1 and second != first, (first, second)
        # The same key from another tenant is another key.
        assert {landed(c, "conv-1", f"{i} tenant two ~{i * 19}", user="other") for i in range(4)}.__len__() == 1
        assert {landed(c, "conv-1", f"{i} back to acme ~{i * 23}") for i in range(4)} == first
    lines = [x for x in caplog.records if x.name == "tieredkv.router.requests" and "/v1/completions" in x.getMessage()]
    keyed = [x for x in lines if "cache_key=conv-1" in x.getMessage()]
    assert len(keyed) == 16 and all(x.request_fields["cache_key"] == "conv-1" for x in keyed)
    assert sum("cache_key" not in x.request_fields for x in lines) == 6


def test_a_key_whose_backend_is_ejected_is_let_go(pair) -> None:
    a, b = pair
    with FaultFront(b.url, mode="pass") as front, RouterThread(a.url, front.url, **FAST) as r, r.client() as c:
        assert r.health()["backends_up"] == 2
        sticky = r.router.proxy.sticky
        keys = {f"k{i}": landed(c, f"k{i}", f"key {i}'s first prompt ~{i * 29}") for i in range(6)}
        on_front = [k for k, url in keys.items() if url == front.url]
        assert on_front and sticky.held_by(front.url) == len(on_front)
        front.mode = "garbage"          # its next answer is refused: ejected, the request retried on a
        assert landed(c, on_front[0], "this one is refused by the front and retried") == a.url
        assert r.backend_view(front.url)["ejected"]
        assert sticky.held_by(front.url) == 0          # every key on it let go, not only the retried one
        # Each of those keys now follows a (the only backend up), and keeps to it once the front is back.
        moved = {k: landed(c, k, f"{k} while the front is out") for k in on_front}
        assert set(moved.values()) == {a.url}
        front.mode = "pass"
        wait_for(lambda: r.backend_view(front.url)["healthy"], timeout=60, what="readmission")
        assert {landed(c, k, f"{k} after the front is back, {i}") for k in on_front for i in range(3)} == {a.url}
