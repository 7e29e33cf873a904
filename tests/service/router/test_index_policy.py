"""The router's index and policy on hand-made event batches in vLLM's wire format.

Batches are encoded with vLLM's own struct definitions (vllm_format.py, written from its
documented format), decoded by the router's decoder, and applied to a PrefixIndex; the policy
then picks a backend from the prefixes the index reports.
"""
from __future__ import annotations

import msgspec
import pytest

from service.router import events
from service.router.index import PrefixIndex
from service.router.policy import Candidate, Policy, choose
from storage import tier_kinds
from tests.service.router import vllm_format as v

H = [bytes([i]) * 32 for i in range(8)]       # a prompt's chained block hashes, in order


def apply(index: PrefixIndex, backend: str, *evs) -> None:
    index.apply_batch(backend, events.decode_batch(v.encode(list(evs))))


def media(prefix: list[int]) -> list[str]:
    return [tier_kinds.media()[r] for r in prefix]


def test_the_decoder_reads_what_vllms_structs_encode_and_encodes_what_they_decode() -> None:
    payload = v.encode([v.stored(H[:2], "CPU", parent=H[7]), v.removed([H[0]], "GPU"), v.AllBlocksCleared()], ts=12.5)
    batch = events.decode_batch(payload)
    assert batch.ts == 12.5
    assert batch.events == [events.BlockStored(H[:2], H[7], list(range(16)), 8, None, "CPU"),
                            events.BlockRemoved([H[0]], "GPU"), events.AllBlocksCleared()]
    # Ours encodes byte for byte what vLLM's structs do, and vLLM's typed decoder reads it.
    assert events.encode_batch(12.5, batch.events) == payload
    assert msgspec.msgpack.decode(payload, type=v.KVEventBatch).events[1] == v.removed([H[0]], "GPU")


def test_the_router_decodes_into_the_publishers_structs_and_reads_a_vllm_servers_rank() -> None:
    """One definition of the wire structs (storage/kv_events/wire.py) for our publisher and the router."""
    from storage.kv_events import wire
    assert (events.BlockStored, events.BlockRemoved, events.AllBlocksCleared) == \
        (wire.BlockStored, wire.BlockRemoved, wire.AllBlocksCleared)
    payload = events.encode_batch(3.0, [v.removed([H[2]], "DISK")], data_parallel_rank=0)
    assert msgspec.msgpack.decode(payload) == [3.0, [["BlockRemoved", [H[2]], "DISK"]], 0]
    assert msgspec.msgpack.decode(payload, type=v.KVEventBatch).data_parallel_rank == 0
    assert isinstance(events.decode_batch(payload), wire.KVEventBatch)


def test_trailing_fields_of_a_newer_publisher_and_unknown_events_are_tolerated() -> None:
    raw = msgspec.msgpack.encode([1.0, [["BlockStored", [H[0]], None, [1] * 8, 8, None, "GPU", "lora-x", 7],
                                        ["SomethingNew", 1, 2], ["BlockRemoved", [H[1]]]], 0])
    batch = events.decode_batch(raw)
    assert batch.events == [events.BlockStored([H[0]], None, [1] * 8, 8, None, "GPU"), events.BlockRemoved([H[1]], None)]
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [[1, 2]]])):
        with pytest.raises(events.BadBatch):
            events.decode_batch(bad)


def test_the_prefix_walks_in_order_takes_the_fastest_medium_and_stops_at_the_first_missing_block() -> None:
    index = PrefixIndex(prediction_ttl_s=0)
    apply(index, "a", v.stored(H[:4], "GPU"), v.stored(H[2:6], "DISK"))
    apply(index, "b", v.stored(H[:2], "CPU"), v.stored(H[3:8], "GPU"))       # b lacks H[2]: its prefix is 2 blocks
    got = index.prefix(H, ["a", "b", "c"])
    assert media(got["a"]) == ["GPU"] * 4 + ["DISK"] * 2
    assert media(got["b"]) == ["CPU", "CPU"]
    assert got["c"] == []
    assert index.media(H[3]) == {"a": ["GPU", "DISK"], "b": ["GPU"]}


def test_removal_takes_away_one_medium_and_a_block_no_medium_holds_is_forgotten() -> None:
    index = PrefixIndex(prediction_ttl_s=0)
    apply(index, "a", v.stored(H[:3], "GPU"), v.stored(H[:3], "CPU"))      # demoted: on both for a while
    apply(index, "a", v.removed(H[:3], "GPU"))
    assert media(index.prefix(H, ["a"])["a"]) == ["CPU"] * 3
    apply(index, "a", v.removed([H[1]], "CPU"))
    assert media(index.prefix(H, ["a"])["a"]) == ["CPU"]
    assert index.blocks("a") == 2 and index.media(H[1]) == {}
    apply(index, "a", v.stored([H[5]], None))                              # vLLM's medium None: the device
    assert index.media(H[5]) == {"a": ["GPU"]}


def test_all_blocks_cleared_and_clear_forget_one_backend_only() -> None:
    index = PrefixIndex(prediction_ttl_s=0)
    apply(index, "a", v.stored(H[:4]))
    apply(index, "b", v.stored(H[:4], "DISK"))
    apply(index, "a", v.AllBlocksCleared())
    assert index.blocks("a") == 0 and len(index.prefix(H, ["b"])["b"]) == 4
    index.clear("b")
    assert index.blocks("b") == 0 and index.media(H[0]) == {}


def test_predictions_count_as_device_blocks_until_they_expire_or_are_removed() -> None:
    now = [100.0]
    index = PrefixIndex(prediction_ttl_s=10, clock=lambda: now[0])
    index.predict("a", H[:3])
    assert media(index.prefix(H, ["a", "b"])["a"]) == ["GPU"] * 3 and index.predicted("a") == 3
    apply(index, "a", v.removed([H[1]], "GPU"))                           # evicted: not predicted any more
    assert len(index.prefix(H, ["a"])["a"]) == 1
    now[0] = 109.0
    index.predict("a", H[:1])                                             # renewed: lives past the first expiry
    now[0] = 111.0
    assert len(index.prefix(H, ["a"])["a"]) == 1 and index.predicted("a") == 1
    now[0] = 120.0
    assert index.prefix(H, ["a"])["a"] == [] and index.predicted("a") == 0
    index.predict("b", H[:2])
    index.clear("b")
    assert index.predicted("b") == 0


def test_the_policy_weighs_the_prefix_by_medium_against_load_and_sends_misses_to_the_least_loaded() -> None:
    policy = Policy(in_flight_tokens=100, queue_weight=0.5)
    gpu, disk = [0] * 10, [2] * 10                                        # ranks: 0 GPU, 2 DISK
    idle = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    # The longest prefix wins; at equal length the device beats the disk.
    assert choose(policy, idle, {"a": gpu[:4], "b": gpu[:8]}, 200, 16).backend == "b"
    assert choose(policy, idle, {"a": disk, "b": gpu}, 200, 16).backend == "b"
    assert choose(policy, idle, {"a": disk, "b": gpu[:4]}, 200, 16).backend == "a"   # 80 weighted beats 64
    # A prefix worth 128 tokens is not worth waiting behind 2 requests (200 tokens of load).
    loaded = [Candidate("a", 2), Candidate("b", 0), Candidate("c", 1)]
    assert choose(policy, loaded, {"a": gpu[:8]}, 200, 16).backend == "b"
    assert choose(policy, [Candidate("a", 1), Candidate("b", 0)], {"a": gpu[:8]}, 200, 16).backend == "a"
    # Queued prefill counts at half: 400 tokens queued on a (200) outweigh its 128-token prefix.
    queued = [Candidate("a", 0, pending_tokens=400), Candidate("b", 0)]
    assert choose(policy, queued, {"a": gpu[:8]}, 200, 16).backend == "b"
    assert choose(policy, queued, {"a": gpu[:8]}, 2000, 16).backend == "b"
    # A tie between waiting behind a prefill and computing it: the hit wins.
    tie = [Candidate("a", 0, pending_tokens=256), Candidate("b", 0)]
    assert choose(policy, tie, {"a": gpu[:8]}, 200, 16).backend == "a"
    # Misses everywhere: the fewest in flight, then the fewest routed, then list order.
    assert choose(policy, loaded, {}, 200, 16).backend == "b"
    assert choose(policy, [Candidate("a", 0, routed=5), Candidate("b", 0, routed=3)], {}, 0, 1).backend == "b"
    assert choose(policy, idle, {}, 0, 1).backend == "a"
    choice = choose(policy, idle, {"c": gpu[:3]}, 100, 16)
    assert (choice.backend, choice.hit_tokens, choice.miss_tokens) == ("c", 48, 52)
    with pytest.raises(ValueError):
        Policy(weights={"GPU": 1.0})
