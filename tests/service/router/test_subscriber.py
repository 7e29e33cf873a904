"""One backend's event stream into the index: sync by replay at start, live batches, gaps filled
by replay, a fresh subscriber (a restarted router) rebuilding the same picture, and no malformed
batch stopping the feed (issue 44). Against a fake publisher speaking vLLM's ZMQ protocol
(vllm_format.FakePublisher) on loopback."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from service.router.events import MAX_BATCH_HASHES, MAX_PAYLOAD_BYTES, BadBatch, decode_batch
from service.router.index import PrefixIndex
from service.router.subscriber import EventSubscriber
from tests.service.router import vllm_format as v

H = [bytes([i]) * 32 for i in range(16)]


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def arrives(cond, within: float) -> bool:
    """Whether cond() holds within `within` seconds (no assertion: the caller tries again)."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def joined(pub: v.FakePublisher, sub: EventSubscriber) -> None:
    """Publish H[0] on the device until one arrives live: ZMQ drops what a joining SUB misses."""
    seq = -1
    for _ in range(200):
        seq = pub.publish(v.encode([v.stored([H[0]])]))
        if await arrives(lambda: sub.last_seq >= seq, 0.05):
            return
    await until(lambda: sub.last_seq >= seq)


def subscriber(pub: v.FakePublisher, index: PrefixIndex, ctx: zmq.asyncio.Context, replay: str | None = "own",
               **kw) -> EventSubscriber:
    return EventSubscriber("a", pub.endpoint, pub.replay_endpoint if replay == "own" else replay, "", index, ctx, **kw)


def test_a_subscriber_syncs_by_replay_follows_live_and_fills_a_gap() -> None:
    pub = v.FakePublisher()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex(prediction_ttl_s=0)
        for i in range(3):                                  # published before anyone listened
            pub.publish(v.encode([v.stored([H[i]], "GPU")]))
        sub = subscriber(pub, index, ctx)
        sub.start()
        await asyncio.wait_for(sub.synced.wait(), 10)
        assert sub.last_seq == 2 and index.blocks("a") == 3 and pub.replay_requests == [0]
        # Live: the SUB socket may still be joining (ZMQ drops what a joining SUB misses, and
        # with nothing after it the subscriber cannot tell), so publish until one arrives.
        for _ in range(200):
            seq = pub.publish(v.encode([v.stored([H[3]], "CPU")]))
            if await arrives(lambda: sub.last_seq >= seq, 0.1):
                break
        await until(lambda: sub.last_seq >= seq)
        # A batch the subscriber never sees live (a gap) is asked for on the replay socket.
        pub.publish(v.encode([v.removed([H[0]], "GPU")]), send=False)
        last = pub.publish(v.encode([v.stored([H[4]], "DISK")]))
        await until(lambda: sub.last_seq == last)
        assert index.media(H[0]) == {} and index.media(H[4]) == {"a": ["DISK"]} and index.blocks("a") == 4
        assert sub.stats.gaps >= 1 and sub.stats.lost == 0 and sub.stats.bad == 0
        assert pub.replay_requests[-1] <= last - 1
        # A restarted router: a fresh index and subscriber rebuild the same picture by replay alone.
        rebuilt = PrefixIndex(prediction_ttl_s=0)
        again = subscriber(pub, rebuilt, ctx)
        again.start()
        await asyncio.wait_for(again.synced.wait(), 10)
        assert again.last_seq == last
        assert {bytes(h): rebuilt.media(h) for h in H} == {bytes(h): index.media(h) for h in H}
        await sub.stop()
        await again.stop()
        ctx.term()
    try:
        asyncio.run(main())
    finally:
        pub.close()


def test_a_silent_replay_socket_loses_its_range_and_the_live_stream_goes_on() -> None:
    pub = v.FakePublisher()
    silent = zmq.Context()
    sink = silent.socket(zmq.ROUTER)                        # accepts the request, never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex(prediction_ttl_s=0)
        sub = subscriber(pub, index, ctx, replay=f"tcp://127.0.0.1:{port}", replay_timeout_s=0.3)
        sub.start()
        await asyncio.wait_for(sub.synced.wait(), 10)
        assert sub.stats.replay_failures == 1
        await joined(pub, sub)
        pub.publish(b"not msgpack \xc1")
        pub.publish(v.encode([v.stored([H[1]])]), send=False)
        last = pub.publish(v.encode([v.stored([H[2]])]))
        await until(lambda: sub.last_seq == last)
        assert sub.stats.bad == 1 and sub.stats.lost == 1 and sub.stats.replay_failures == 2
        assert index.media(H[2]) == {"a": ["GPU"]} and index.media(H[1]) == {}
        await sub.stop()
        ctx.term()
    try:
        asyncio.run(main())
    finally:
        sink.close(linger=0)
        silent.term()
        pub.close()


def malformed_batches() -> dict[str, bytes]:
    """Each kind of batch a broken or hostile publisher sent on 2026-11-28 (issue 44) or could."""
    enc = msgspec.msgpack.encode
    h = H[5]
    return {
        "no ts, no events": enc([None, [], 0]),
        "a ts that is not a number": enc(["yesterday", [], 0]),
        "an infinite ts": enc([float("inf"), [], 0]),
        "a medium that is not a string": enc([0.0, [["BlockStored", [h], None, [1] * 8, 8, None, 7]]]),
        "a removal's medium that is a map": enc([0.0, [["BlockRemoved", [h], {"x": 1}]]]),
        "a block size that is a string": enc([0.0, [["BlockStored", [h], None, [1] * 8, "8", None, "GPU"]]]),
        "token ids that are not a list": enc([0.0, [["BlockStored", [h], None, 5, 8, None, "GPU"]]]),
        "hashes that are not a list": enc([0.0, [["BlockStored", 12, None, [1] * 8, 8, None, "GPU"]]]),
        "a hash that is a float": enc([0.0, [["BlockRemoved", [1.5], "GPU"]]]),
        "an event that is a number": enc([0.0, [42]]),
        "a batch that is a string": enc("batch"),
        "too many hashes": enc([0.0, [["BlockRemoved", [h] * (MAX_BATCH_HASHES + 1), "GPU"]]]),
        "too many bytes": b"\x00" * (MAX_PAYLOAD_BYTES + 1),
    }


def test_every_malformed_batch_is_counted_and_skipped_and_the_feed_goes_on() -> None:
    pub = v.FakePublisher()
    bad = malformed_batches()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex(prediction_ttl_s=0)
        sub = subscriber(pub, index, ctx)
        sub.start()
        await asyncio.wait_for(sub.synced.wait(), 10)
        await joined(pub, sub)
        for i, payload in enumerate(bad.values()):
            pub.publish(payload)
            pub.publish(v.encode([v.stored([H[1 + i % 4]], "CPU")]))   # a sound batch after each
        last = pub.publish(v.encode([v.stored([H[9]], "DISK")]))
        await until(lambda: sub.last_seq == last)
        assert sub.stats.bad == len(bad) and sub.stats.running == 1 and sub.stats.lost == 0
        assert index.media(H[9]) == {"a": ["DISK"]} and index.media(H[1]) == {"a": ["CPU"]}
        assert index.media(H[5]) == {}                       # nothing of a refused batch applied
        await sub.stop()
        ctx.term()
    try:
        asyncio.run(main())
    finally:
        pub.close()


def test_vllms_tagged_map_batches_are_read_by_field_name() -> None:
    # msgspec's tagged structs without array_like encode as maps with the tag under "type".
    enc = msgspec.msgpack.encode
    payload = enc({"ts": 1.5, "events": [
        {"type": "BlockStored", "block_hashes": [H[0], 7], "parent_block_hash": None, "token_ids": list(range(16)),
         "block_size": 8, "lora_id": None, "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [H[1]], "medium": None},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNewer", "x": 1}]})
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved",
                                                                         "AllBlocksCleared"]
    assert batch.events[0].block_hashes[0] == H[0] and batch.events[0].medium == "CPU"
    assert batch.events[1].medium is None and batch.events[0].block_size == 8


def test_each_malformed_batch_is_a_bad_batch_never_another_error() -> None:
    for name, payload in malformed_batches().items():
        with pytest.raises(BadBatch):
            decode_batch(payload)


def test_a_curve_backend_feeds_the_router_it_allows_and_no_other(tmp_path) -> None:
    """The router's keypair (CurveClient) syncs and follows a backend whose sockets take CURVE;
    without a key, or with one the backend does not allow, nothing reaches the index."""
    from service.router.subscriber import CurveClient
    from storage.kv_events.access import Access
    from storage.kv_events.keys import read_keypair, server_keypair, write_keypair
    from tests.kv_event_keys import client_keypair
    server = server_keypair(tmp_path / "server.key_secret", "test")
    stranger = read_keypair(write_keypair(tmp_path, "stranger")[1], "test")
    pub = v.FakePublisher(access=Access(server, frozenset({client_keypair().public})))

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub.publish(v.encode([v.stored([H[0]], "GPU")]))                # history a replay serves
        refused = []
        for curve in (None, CurveClient(stranger, server.public)):
            index = PrefixIndex(prediction_ttl_s=0)
            sub = subscriber(pub, index, ctx, replay_timeout_s=0.5, curve=curve)
            sub.start()
            await asyncio.wait_for(sub.synced.wait(), 10)
            refused.append((sub, index))
        index = PrefixIndex(prediction_ttl_s=0)
        allowed = subscriber(pub, index, ctx, curve=CurveClient(client_keypair(), server.public))
        allowed.start()
        await asyncio.wait_for(allowed.synced.wait(), 10)
        assert allowed.stats.replayed == 1 and index.media(H[0]) == {"a": ["GPU"]}
        await joined(pub, allowed)                                      # and live
        for sub, idx in refused:
            assert sub.stats.replay_failures == 1 and sub.stats.batches == 0 and sub.last_seq == -1
            assert idx.blocks("a") == 0
            await sub.stop()
        await allowed.stop()
        ctx.term()
    try:
        asyncio.run(main())
    finally:
        pub.close()
