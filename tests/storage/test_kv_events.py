"""KV events over real ZMQ sockets on loopback: a TieredKVCache (real LMDB, real zstd) publishes
every tier transition, and a subscriber written here from vLLM's documented format -- its own
msgspec structs, no vLLM import, nothing of storage/kv_events/wire.py on the decoding side --
reads them: every medium as blocks move device -> host -> disk and back, removals on eviction,
no gap in the sequence, replay of a missed range, tokens left out, the sink's bounded queue, the
endpoints' defaults and validation. Over tcp, with CURVE keys (tests/kv_event_keys.py): a tcp
endpoint takes them (who may subscribe: tests/storage/test_kv_events_access.py). No timing
asserts: polling with generous deadlines."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Union

import msgspec
import pytest
import zmq

from storage.config import CacheConfig
from storage.hashing import BlockKey, block_keys
from storage.kv_events.endpoints import DEFAULT_ENDPOINT, check_endpoint, default_replay, needs_curve
from storage.kv_events.access import prepare
from storage.kv_events.sink import EventSink, NO_EVENTS
from storage.layout import BlockLayout
from storage.kv_events.keys import CurveKeypair
from storage.tiered_cache import TieredKVCache
from tests.kv_event_keys import client_keypair, events_options
from tests.storage.conftest import NS, TINY, keys
from tests.storage.test_tiered_cache import fill

DEADLINE_S = 30.0


# ---- the subscriber's side: vLLM's format as its docs and source declare it ----------------

class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: Union[bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: Union[str, None]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


USE_SERVER_KEY = "the server's key, with the test client's keypair"


def client_socket(kind: int, keypair: CurveKeypair | None, server_key: str | None) -> zmq.Socket:
    """A socket of `kind`, a CURVE client of `server_key` with `keypair` (None: no key at all)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keypair is not None:
        sock.curve_secretkey, sock.curve_publickey = keypair.secret, keypair.public
        sock.curve_serverkey = server_key.encode()
    return sock


class Subscriber:
    """A SUB socket on the events endpoint and a DEALER on the replay endpoint; CURVE clients where
    the server has a key (`keypair`: the test client's, another, or None for no key at all)."""

    def __init__(self, status: dict, topic: str = "", keypair: CurveKeypair | None | str = USE_SERVER_KEY) -> None:
        self.ctx = zmq.Context.instance()
        self.keypair = (client_keypair() if status.get("server_key") else None) if keypair == USE_SERVER_KEY \
            else keypair
        self.server_key = status.get("server_key")
        self.sub = client_socket(zmq.SUB, self.keypair, self.server_key)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(status["endpoint"])
        self.replay_endpoint = status["replay_endpoint"]
        self.batches: dict[int, bytes] = {}      # seq -> payload, live
        self.topic = topic

    def poll(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode()
            self.batches[int.from_bytes(seq, "big")] = payload
            timeout_ms = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch from `start`, up to the end marker."""
        dealer = client_socket(zmq.DEALER, self.keypair, self.server_key)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(int(DEADLINE_S * 1000)), "no end marker from the replay socket"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close()

    def all_batches(self, last_seq: int) -> list[KVEventBatch]:
        """Every batch 0..last_seq: live ones, the missed start (a SUB joins late) replayed. The
        live ones must have no gap; the replayed ones must be exactly the missed range."""
        live = sorted(self.batches)
        assert live, "no batch arrived live"
        assert live == list(range(live[0], live[-1] + 1)), f"a gap in the live sequence: {live}"
        missed = self.replay(0)
        assert [s for s, _ in missed][:live[0]] == list(range(live[0])), "replay did not return the missed range"
        for seq, payload in missed:
            if seq in self.batches:
                assert self.batches[seq] == payload, f"replayed batch {seq} differs from the live one"
        payloads = dict(missed) | self.batches
        assert sorted(payloads) == list(range(len(payloads))) and len(payloads) > last_seq
        return [DECODER.decode(payloads[s]) for s in range(len(payloads))]

    def close(self) -> None:
        self.sub.close()


def wait_for(cond: Callable[[], bool], what: str, sub: Subscriber | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if sub is not None:
            sub.poll(20)
        else:
            time.sleep(0.01)


def events_cache(path: Path | None, pages: int, host_slots: int, layout: BlockLayout = TINY, **kw) -> TieredKVCache:
    """A cache publishing on `kv_events` (a free loopback port), over tcp with the test client's key allowed."""
    endpoint = kw.pop("kv_events", "tcp://127.0.0.1:0")
    events = events_options(endpoint) if endpoint is not None and needs_curve(endpoint) else {"kv_events": endpoint}
    config = CacheConfig(block_size=layout.block_size, device_memory=pages * layout.nbytes,
                         host_memory=host_slots * layout.nbytes, disk_dir=None if path is None else str(path),
                         disk_capacity=64 << 20, **events, **kw)
    return TieredKVCache(layout, config, num_pages=pages)


@pytest.fixture
def made():
    caches: list[TieredKVCache] = []
    subs: list[Subscriber] = []
    yield caches, subs
    for s in subs:
        s.close()
    for c in caches:
        c.close()


def start(made, *a, topic: str = "", **kw) -> tuple[TieredKVCache, Subscriber]:
    cache = events_cache(*a, kv_events_topic=topic, **kw)
    made[0].append(cache)
    sub = Subscriber(cache.events_status(), topic)
    made[1].append(sub)
    return cache, sub


def settle(cache: TieredKVCache, sub: Subscriber) -> list[KVEventBatch]:
    """Wait until the publisher sent everything queued and the subscriber has it; every batch."""
    for below in cache.tiers.lower:               # the writers' commits are events too
        assert below.drain(DEADLINE_S)
    sink = cache.tiers.events
    wait_for(lambda: sink.queue.empty(), "the sink to drain")
    seq = [-2]

    def caught_up() -> bool:
        now = cache.events_status()["seq"]
        if now != seq[0]:          # something went out since the last look: look again
            seq[0] = now
            return False
        if sink.queue.empty() and 0 <= max(sub.batches, default=-1) < now or not sub.batches and now >= 0:
            # A SUB that joined after the last batches went out (ZMQ's slow joiner: nothing more is
            # published after them) gets them from the replay socket, as a router would.
            for s, payload in sub.replay(max(sub.batches, default=-1) + 1):
                sub.batches.setdefault(s, payload)
        return sink.queue.empty() and max(sub.batches, default=-1) >= now
    wait_for(caught_up, "the subscriber to catch up", sub)
    return sub.all_batches(cache.events_status()["seq"])


def flat(batches: list[KVEventBatch]) -> list[tuple[str, str | None, bytes]]:
    """(kind, medium, hash) per block, in order; AllBlocksCleared as ("cleared", None, b"")."""
    out = []
    for b in batches:
        for e in b.events:
            if isinstance(e, AllBlocksCleared):
                out.append(("cleared", None, b""))
            else:
                kind = "stored" if isinstance(e, BlockStored) else "removed"
                out += [(kind, e.medium, h) for h in e.block_hashes]
    return out


def held(events: list[tuple[str, str | None, bytes]]) -> dict[str, set[bytes]]:
    """What a router's index believes each medium holds after these events."""
    index: dict[str, set[bytes]] = {}
    for kind, medium, h in events:
        if kind == "cleared":
            index.clear()
        elif kind == "stored":
            index.setdefault(medium, set()).add(h)
        else:
            index.setdefault(medium, set()).discard(h)
    return {m: s for m, s in index.items() if s}


def truth(cache: TieredKVCache) -> dict[str, set[bytes]]:
    with cache.tiers.lock:
        out = {"GPU": {cache.pool.key_of(p).hash for p in cache.pool.cached_pages()},
               "CPU": set(cache.host.hashes())}
    if cache.disk is not None:
        assert cache.disk.drain(timeout=DEADLINE_S)
        out["DISK"] = {b.hash for b in cache.disk.iter_blocks()}
    return {m: s for m, s in out.items() if s}


# ---- the tests ---------------------------------------------------------------------------

def test_every_medium_as_blocks_move_down_the_tiers_and_back(tmp_path: Path, made) -> None:
    cache, sub = start(made, tmp_path / "disk", 4, 2, kv_events_tokens=True)
    ks = keys(8)
    cache.release(fill(cache, ks[:4]))           # GPU: k0..k3
    cache.release(fill(cache, ks[4:]))           # evicts k0..k3: host k2, k3; k0, k1 through it to disk
    batches = settle(cache, sub)
    ev = flat(batches)
    assert ev[0] == ("cleared", None, b"")       # the first batch (seq 0) voids an old index
    assert batches[0].events[0] == AllBlocksCleared()
    h = [k.hash for k in ks]
    assert [x for x in ev if x[1] == "GPU" and x[0] == "stored"] == [("stored", "GPU", x) for x in h]
    assert {x[2] for x in ev if x == ("removed", "GPU", x[2])} == set(h[:4])
    assert held(ev) == truth(cache)
    assert held(ev)["GPU"] == set(h[4:]) and held(ev)["CPU"] == set(h[2:4]) and held(ev)["DISK"] == set(h[:2])

    # flush: everything down to disk (the device and host keep their copies)
    assert cache.flush(DEADLINE_S).complete
    ev = flat(settle(cache, sub))
    assert held(ev)["DISK"] == set(h) and held(ev) == truth(cache)

    # demote device then host: the device and host media empty, the disk keeps every block
    cache.demote("device")
    cache.demote("host")
    ev = flat(settle(cache, sub))
    assert "GPU" not in held(ev) and held(ev) == truth(cache)

    # and back up: a disk hit is promoted into device pages (BlockStored GPU, as one chain)
    acq = cache.load_now(cache.match(ks[:3]))
    assert acq.tiers == ("disk", "disk", "disk")
    cache.release(acq.pages)
    batches = settle(cache, sub)
    ev = flat(batches)
    assert held(ev)["GPU"] >= set(h[:3]) and held(ev) == truth(cache)
    last_gpu = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "GPU"][-1]
    assert last_gpu.block_hashes == h[:3]
    assert last_gpu.parent_block_hash is None    # the chain's root: no parent block
    assert last_gpu.token_ids == [t for k in ks[:3] for t in k.token_ids]
    assert last_gpu.block_size == TINY.block_size and last_gpu.lora_id is None

    # a prefetch brings disk blocks into the host tier (BlockStored CPU), evicting as it goes
    cache.demote("host")
    pre = cache.prefetch(ks[3:8])
    assert pre.wait(DEADLINE_S)
    ev = flat(settle(cache, sub))
    assert held(ev)["CPU"] and held(ev) == truth(cache)

    # drop the disk: BlockRemoved DISK for every block it held
    cache.drop("disk")
    ev = flat(settle(cache, sub))
    assert "DISK" not in held(ev) and held(ev) == truth(cache)
    st = cache.events_status()
    assert st["dropped"] == 0 and st["published"] == len([1 for b in sub.all_batches(st["seq"]) for _ in b.events])


def test_a_stored_event_carries_the_parent_and_the_tokens_of_its_chain(tmp_path: Path, made) -> None:
    cache, sub = start(made, None, 8, 0, kv_events_tokens=True)
    ks = keys(3)
    pages = cache.allocate(3)
    for p, k in zip(pages, ks):
        assert cache.register(p, k)
    assert cache.register(pages[0], ks[0])       # registering a page again says nothing new
    stored = [e for b in settle(cache, sub) for e in b.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [k.hash for k in ks]
    # however the blocks were batched, each event's parent is the block before its first
    for e in stored:
        i = [k.hash for k in ks].index(e.block_hashes[0])
        assert e.parent_block_hash == (None if i == 0 else ks[i - 1].hash)
        assert e.token_ids == [t for k in ks[i:i + len(e.block_hashes)] for t in k.token_ids]
        assert e.medium == "GPU"


def test_raw_msgpack_layout_is_vllms(tmp_path: Path, made) -> None:
    """Without any struct: [ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]], 0]:
    vLLM's EventBatch ends with `data_parallel_rank`, which its publisher fills in (0 for one server)."""
    cache, sub = start(made, None, 4, 0, topic="kv", kv_events_tokens=True)
    k = keys(1)[0]
    page = cache.allocate(1)[0]
    cache.register(page, k)
    settle(cache, sub)
    raw = [msgspec.msgpack.decode(p) for _, p in sub.replay(0)]
    assert raw[0][1][0] == ["AllBlocksCleared"] and isinstance(raw[0][0], float)
    assert [len(b) for b in raw] == [3] * len(raw) and {b[2] for b in raw} == {0}
    stored = [e for b in raw for e in b[1] if e[0] == "BlockStored"]
    assert stored == [["BlockStored", [k.hash], None, list(k.token_ids), TINY.block_size, None, "GPU"]]


def test_replay_returns_exactly_the_missed_batches_then_the_end_marker(made) -> None:
    cache, sub = start(made, None, 4, 0)
    ks = keys(40)
    for i in range(0, 40, 4):                     # several batches: each waits for the last to go out
        before = cache.events_status()["seq"]
        pages = cache.allocate(4)
        for p, k in zip(pages, ks[i:i + 4]):
            cache.register(p, k)
        cache.release(pages)
        wait_for(lambda: cache.events_status()["seq"] > before, "a batch")
    settle(cache, sub)
    last = cache.events_status()["seq"]
    assert last >= 9                              # (the first may share the clear's batch)
    everything = sub.replay(0)
    assert [s for s, _ in everything] == list(range(last + 1))
    # a subscriber that saw up to seq 4 asks for 5 on: exactly 5..last, each the batch it missed
    missed = sub.replay(5)
    assert missed == everything[5:]
    assert sub.replay(last + 1) == []             # nothing missed: only the end marker
    # the live stream has no gap and agrees byte for byte with the replay
    live = sorted(sub.batches)
    assert live == list(range(live[0], last + 1))
    assert all(dict(everything)[s] == sub.batches[s] for s in live)


def test_the_replay_ring_keeps_the_last_batches(made) -> None:
    from storage.kv_events.publisher import KVEventPublisher
    sink = EventSink()
    pub = KVEventPublisher(sink, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=4, buffer_batches=3,
                           access=prepare(CacheConfig(disk_dir=None, **events_options())))
    try:
        wait_for(lambda: pub.seq == 0, "the clear")
        for k in keys(5):
            before = pub.seq
            sink.stored([k], "GPU")
            wait_for(lambda: pub.seq > before, "a batch")
        sub = Subscriber(pub.status())
        try:
            got = sub.replay(0)
        finally:
            sub.close()
        assert [s for s, _ in got] == [3, 4, 5]     # seq 0 (the clear) and 1, 2 fell out of the ring
        assert [DECODER.decode(p).events[0].block_hashes for _, p in got] == [[k.hash] for k in keys(5)[2:]]
    finally:
        pub.close()


@pytest.mark.parametrize("tokens", [None, True])
def test_token_ids_are_left_out_unless_asked_for(made, tokens: bool | None) -> None:
    """A tenant's prompt text is not on the stream by default (kv_events_tokens=True puts it there)."""
    cache, sub = start(made, None, 4, 0, **({} if tokens is None else {"kv_events_tokens": tokens}))
    pages = cache.allocate(2)
    for p, k in zip(pages, keys(2)):
        cache.register(p, k)
    stored = [e for b in settle(cache, sub) for e in b.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2
    if tokens:
        assert [t for e in stored for t in e.token_ids] == [t for k in keys(2) for t in k.token_ids]
    else:
        assert stored and all(e.token_ids == [] for e in stored)
    assert cache.events_status()["tokens"] is bool(tokens)


def test_a_full_queue_drops_and_counts_and_never_blocks() -> None:
    sink = EventSink(max_items=2)
    ks = keys(5)
    t0 = time.monotonic()
    sink.stored(ks[:2], "GPU")
    sink.removed([ks[0].hash], "GPU")
    sink.stored(ks[2:5], "CPU")                   # no room: its 3 blocks are dropped
    sink.cleared()                                # and this one
    assert time.monotonic() - t0 < DEADLINE_S     # (a blocking put would hang here forever)
    assert sink.dropped == 4
    assert sink.queue.qsize() == 2
    NO_EVENTS.stored(ks, "GPU")                   # events off: nothing, nowhere


def test_a_publisher_behind_a_full_queue_reports_its_drops(made) -> None:
    cache, sub = start(made, None, 4, 0)
    sink, pub = cache.tiers.events, cache.events_publisher
    stalled = threading.Event()

    def take_nothing() -> list:
        stalled.set()
        time.sleep(0.001)
        return []
    pub._take = take_nothing                      # the publisher stops taking (a stalled thread)...
    # ...once its current take (which may be waiting on the queue, and would take what we put
    # next) has returned: only then is the queue ours to fill.
    assert stalled.wait(DEADLINE_S)
    for _ in range(sink.queue.maxsize - sink.queue.qsize()):
        sink.removed([b"x" * 32], "GPU")
    pages = cache.allocate(2)                     # the engine's path: never waits on the queue
    for p, k in zip(pages, keys(2)):
        assert cache.register(p, k)
    assert cache.events_status()["dropped"] == 2
    del pub._take                                 # it takes again: drains the rest, no gap
    ev = flat(settle(cache, sub))
    assert not any(h in {k.hash for k in keys(2)} for _, _, h in ev)


def test_the_endpoint_defaults_to_loopback_and_reports_what_it_bound(made) -> None:
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    assert default_replay(DEFAULT_ENDPOINT) == "tcp://127.0.0.1:5558"
    assert default_replay("tcp://*:0") == "tcp://*:0"
    assert default_replay("ipc:///tmp/kv") == "ipc:///tmp/kv.replay"
    assert default_replay("inproc://kv") == "inproc://kv-replay"
    from tieredkv.cli import bare_kv_events
    assert bare_kv_events(["serve", "--kv-events", "--port", "0"]) == ["serve", "--kv-events", DEFAULT_ENDPOINT,
                                                                       "--port", "0"]
    assert bare_kv_events(["serve", "--kv-events"])[-1] == DEFAULT_ENDPOINT
    assert bare_kv_events(["serve", "--kv-events", "tcp://*:9"]) == ["serve", "--kv-events", "tcp://*:9"]
    assert CacheConfig(disk_dir=None).kv_events is None            # off unless asked for
    cache, _ = start(made, None, 4, 0)
    st = cache.events_status()
    assert st["endpoint"].startswith("tcp://127.0.0.1:") and st["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert not st["endpoint"].endswith(":0") and st["endpoint"] != st["replay_endpoint"]
    assert set(st) == {"enabled", "endpoint", "replay_endpoint", "topic", "seq", "published", "dropped", "tokens",
                       "server_key", "replay_s"}
    assert len(st["server_key"]) == 40 and st["replay_s"] == 300.0


def test_inproc_endpoints(made) -> None:
    name = f"inproc://kv-{os.getpid()}-{time.monotonic_ns()}"
    cache, sub = start(made, None, 4, 0, kv_events=name)
    assert cache.events_status()["endpoint"] == name
    assert cache.events_status()["replay_endpoint"] == name + "-replay"
    page = cache.allocate(1)[0]
    cache.register(page, keys(1)[0])
    assert ("stored", "GPU", keys(1)[0].hash) in flat(settle(cache, sub))


@pytest.mark.parametrize("field, kw", [
    ("kv_events", {"kv_events": "http://127.0.0.1:5557"}),
    ("kv_events", {"kv_events": "tcp://127.0.0.1"}),
    ("kv_events", {"kv_events": "tcp://127.0.0.1:70000"}),
    ("kv_events", {"kv_events": "ipc://"}),
    ("kv_events", {"kv_events": 5557}),
    ("kv_events_replay", {"kv_events": "tcp://127.0.0.1:65535"}),
    ("kv_events_replay", {"kv_events_replay": "tcp://127.0.0.1:5558"}),
    ("kv_events_replay", {"kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "tcp://:5558"}),
    ("kv_events_replay", {"kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "tcp://127.0.0.1:5557"}),
    ("kv_events_tokens", {**events_options("tcp://127.0.0.1:5557"), "kv_events_tokens": "no"}),
    ("kv_events_topic", {**events_options("tcp://127.0.0.1:5557"), "kv_events_topic": b"kv"}),
    ("kv_events_replay_s", {**events_options("tcp://127.0.0.1:5557"), "kv_events_replay_s": 0}),
    ("kv_events_secret_file", {**events_options("tcp://127.0.0.1:5557"), "kv_events_secret_file": None}),
    ("kv_events_allow_keys", {"kv_events_allow_keys": "/k", "kv_events_secret_file": "/s"}),
])
def test_bad_event_config_is_a_value_error_naming_the_field(field: str, kw: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        CacheConfig(disk_dir=None, **kw)


def test_good_endpoints_pass() -> None:
    for ep in ("tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://localhost:0", "tcp://[::1]:*", "ipc:///tmp/kv.sock",
               "inproc://kv"):
        assert check_endpoint(ep, "kv_events") == ep
        CacheConfig(disk_dir=None, **events_options(ep))


def test_a_taken_port_fails_the_cache_and_leaves_nothing_running(tmp_path: Path, made) -> None:
    cache, _ = start(made, None, 4, 0)
    taken = cache.events_status()["endpoint"]
    with pytest.raises(OSError, match="kv_events: cannot bind"):
        events_cache(tmp_path / "disk2", 4, 2, kv_events=taken, kv_events_replay="tcp://127.0.0.1:0")


def test_a_restarted_cache_clears_then_announces_what_its_disk_holds(tmp_path: Path, made) -> None:
    first = events_cache(tmp_path / "disk", 8, 2, kv_events=None)
    ks = keys(3, ns=NS) + block_keys(b"\x02" * 32, list(range(8)), TINY.block_size)
    first.release(fill(first, ks))
    assert first.flush(DEADLINE_S).complete
    first.close()
    cache, sub = start(made, tmp_path / "disk", 4, 2, kv_events_tokens=True)
    wait_for(lambda: cache._announcer is None or not cache._announcer.is_alive(), "the announcement")
    ev = flat(settle(cache, sub))
    assert ev[0] == ("cleared", None, b"")
    assert held(ev) == {"DISK": {k.hash for k in ks}}
    stored = [e for b in sub.all_batches(cache.events_status()["seq"]) for e in b.events if isinstance(e, BlockStored)]
    by_hash = {e.block_hashes[0]: e for e in stored}
    for k in ks:                                   # read back from the disk's records: tokens and parents
        e = by_hash[k.hash]
        assert e.token_ids == list(k.token_ids)
        assert e.parent_block_hash == (None if k in (ks[0], ks[3]) else k.parent)


def test_close_publishes_a_last_clear(made) -> None:
    cache, sub = start(made, None, 4, 0)
    pages = cache.allocate(1)
    cache.register(pages[0], keys(1)[0])
    settle(cache, sub)
    made[0].remove(cache)
    cache.close()
    wait_for(lambda: any(DECODER.decode(p).events == [AllBlocksCleared()] for s, p in sub.batches.items() if s > 0),
             "the last clear", sub)


def test_the_remote_store_is_a_medium(tmp_path: Path, made, valkey) -> None:
    cache, sub = start(made, None, 4, 2, remote_url=valkey.url)
    ks = keys(3, ns=os.urandom(32))
    cache.release(fill(cache, ks))
    r = cache.flush(DEADLINE_S)
    assert r.remote is True
    ev = flat(settle(cache, sub))
    assert held(ev)["REMOTE"] == {k.hash for k in ks}
    assert cache.remote.delete(ks[1])              # we delete it: BlockRemoved REMOTE
    ev = flat(settle(cache, sub))
    assert held(ev)["REMOTE"] == {ks[0].hash, ks[2].hash}
