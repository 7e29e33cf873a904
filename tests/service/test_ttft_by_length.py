"""Issue 40: the dashboard's TTFT comparison is like with like -- RecentTTFT.by_length buckets
recent TTFTs by prompt length and keeps only the lengths where a miss and a hit both ran, so a
device hit of a long prompt is never set beside misses of short ones."""
from __future__ import annotations

from service.metrics import RecentTTFT


def test_only_lengths_with_a_miss_and_a_hit_are_compared() -> None:
    r = RecentTTFT()
    for _ in range(3):
        r.add("miss", 0.020, 100)           # short misses
        r.add("device", 0.200, 5000)        # long device hits: slower than the short misses
    r.add("miss", 0.300, 5000)              # a long miss: now the long prompts compare
    r.add("device", 0.004, 110)             # a short hit
    r.add("host", 0.050, 40)                # a host hit with no miss of its length: not compared
    got = r.by_length()
    assert list(got) == ["64-127", "4096-8191"]
    short, long_ = got["64-127"], got["4096-8191"]
    assert (short["p50_s"]["device"], short["p50_s"]["miss"]) == (0.004, 0.020)
    assert (long_["p50_s"]["device"], long_["p50_s"]["miss"]) == (0.200, 0.300)
    assert long_["requests"] == {"device": 3, "host": 0, "disk": 0, "remote": 0, "miss": 1}
    assert short["p50_s"]["host"] is None
    # Within each length a hit is faster than a miss -- unlike the raw medians, which mix lengths.
    raw = r.summary()
    assert raw["device"]["p50_s"] > raw["miss"]["p50_s"]
    assert all(b["p50_s"]["device"] < b["p50_s"]["miss"] for b in got.values())


def test_a_prompt_of_unknown_length_is_left_out() -> None:
    r = RecentTTFT()
    r.add("miss", 0.1, 0)
    r.add("device", 0.01, 0)
    assert r.by_length() == {}
