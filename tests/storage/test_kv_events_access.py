"""Who may subscribe to a server's KV events (issue 44 item 2): the stream names tenants' prefixes,
so a tcp endpoint serves only the CURVE keys the operator allowed -- a subscriber without a key,
or with a stranger's, completes no handshake and gets no live batch and no replay (its socket's
own monitor says why) while an allowed one gets both -- and a tcp endpoint without keys does not
start; an ipc socket binds in a directory only its user (or group) can enter, its file 0600;
token ids stay off the wire unless asked for; the replay ring forgets batches older than its time
bound (an injected clock, no sleeps); key files are written 0600 and refused when others can read
them. Real ZMQ sockets on loopback and in tmp directories."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from storage.config import CacheConfig
from storage.kv_events.access import Access, prepare
from storage.kv_events.keys import read_keypair, read_public_keys, server_keypair, write_keypair
from storage.kv_events.publisher import KVEventPublisher
from storage.kv_events.sink import EventSink
from tests.kv_event_keys import events_options
from tests.storage.conftest import keys
from tests.storage.test_kv_events import (DECODER, DEADLINE_S, BlockStored, Subscriber, client_socket, settle, start,
                                          wait_for)
from tests.storage.test_kv_events import made  # noqa: F401 -- the fixture

FAILED = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def handshake_fails(sock: zmq.Socket, endpoint: str, send: list[bytes] | None = None) -> int:
    """Connect `sock` to `endpoint` (queueing `send` on the new connection) and wait (a generous
    deadline) for its first handshake's verdict, as its own monitor reports it: the failure's
    event, or an AssertionError if it got in."""
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        if send is not None:
            sock.send_multipart(send, flags=zmq.NOBLOCK)
        while True:
            assert monitor.poll(int(DEADLINE_S * 1000)), "no handshake verdict"
            event = recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, f"{endpoint} let a subscriber in without an allowed key"
            if event in FAILED:          # (which one: how far the handshake got, a race of the two ends)
                return event
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


@pytest.mark.parametrize("who", ["no key", "a stranger's key"])
def test_a_subscriber_the_operator_did_not_allow_gets_nothing_live_or_replayed(made, tmp_path: Path,  # noqa: F811
                                                                               who: str) -> None:
    cache, allowed = start(made, None, 4, 0, kv_events_tokens=True)
    st = cache.events_status()
    stranger = read_keypair(write_keypair(tmp_path, "stranger")[1], "test")     # a key, not on the list
    keypair = None if who == "no key" else stranger
    sub, dealer = (client_socket(kind, keypair, st["server_key"]) for kind in (zmq.SUB, zmq.DEALER))
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert handshake_fails(sub, st["endpoint"]) in FAILED
        history = [b"", (0).to_bytes(8, "big")]                               # a replay from seq 0
        assert handshake_fails(dealer, st["replay_endpoint"], send=history) in FAILED
        # alice's prompt goes out, and the allowed subscriber has it live and replayed...
        k = keys(1)[0]
        page = cache.allocate(1)[0]
        cache.register(page, k)

        def allowed_has_it() -> bool:
            return any(isinstance(e, BlockStored) and e.block_hashes == [k.hash]
                       for p in allowed.batches.values() for e in DECODER.decode(p).events)
        # Live, or -- a SUB that joined after the batch went out (ZMQ's slow joiner) -- from the
        # replay socket, as a router would: settle() does both (a bare wait for the live batch
        # timed out once under a loaded machine).
        settle(cache, allowed)
        assert allowed_has_it()
        replayed = [e for _, p in allowed.replay(0) for e in DECODER.decode(p).events if isinstance(e, BlockStored)]
        assert replayed[-1].token_ids == list(k.token_ids)
        # ...while the other, whose sockets were refused before it, has nothing at all.
        assert not sub.poll(0) and not dealer.poll(0)
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://*:5557", "ipc://@tieredkv-abstract"])
def test_an_endpoint_anyone_on_the_host_reaches_does_not_start_without_keys(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"^kv_events: .*any local user.*kv-events-keys"):
        CacheConfig(disk_dir=None, kv_events=endpoint)
    with pytest.raises(ValueError, match=r"^kv_events: .*any local user"):
        KVEventPublisher(EventSink(), endpoint, "inproc://never", block_size=4)
    with pytest.raises(ValueError, match=r"^kv_events_replay: .*any local user"):
        KVEventPublisher(EventSink(), "inproc://never", "tcp://127.0.0.1:0", block_size=4)


@pytest.fixture
def short_tmp():
    """A tmp directory with a short path (a unix socket's path is at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="tkv-ipc-"))
    yield d
    shutil.rmtree(d, True)


def test_an_ipc_socket_binds_where_only_its_user_can_connect(made, short_tmp: Path) -> None:  # noqa: F811
    endpoint = f"ipc://{short_tmp}/kv/events.sock"
    cache, sub = start(made, None, 4, 0, kv_events=endpoint)
    st = cache.events_status()
    assert st["endpoint"] == endpoint and st["replay_endpoint"] == endpoint + ".replay" and st["server_key"] is None
    assert stat.S_IMODE((short_tmp / "kv").stat().st_mode) == 0o700                # made private
    for f in ("events.sock", "events.sock.replay"):
        mode = (short_tmp / "kv" / f).stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    k = keys(1)[0]
    cache.register(cache.allocate(1)[0], k)                                        # its user subscribes
    settle(cache, sub)                                   # live, or replayed for a late-joining SUB
    assert any(isinstance(e, BlockStored) and k.hash in e.block_hashes
               for p in sub.batches.values() for e in DECODER.decode(p).events)
    # A directory its group may enter: the socket admits the group too, no one else.
    (short_tmp / "team").mkdir(mode=0o750)
    os.chmod(short_tmp / "team", 0o750)
    cache2, _ = start(made, None, 4, 0, kv_events=f"ipc://{short_tmp}/team/events.sock")
    assert stat.S_IMODE((short_tmp / "team" / "events.sock").stat().st_mode) == 0o660


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o701])
def test_an_ipc_socket_in_a_directory_others_can_enter_is_refused(short_tmp: Path, mode: int) -> None:
    d = short_tmp / "open"
    d.mkdir()
    os.chmod(d, mode)
    config = CacheConfig(disk_dir=None, kv_events=f"ipc://{d}/events.sock")
    with pytest.raises(ValueError, match=rf"^kv_events: .*{d} is open to other users \(mode {mode:04o}\)"):
        prepare(config)
    with pytest.raises(ValueError, match=r"^kv_events: .*open to other users"):
        KVEventPublisher(EventSink(), f"ipc://{d}/events.sock", "inproc://never", block_size=4)
    assert not (d / "events.sock").exists()


def test_keys_on_an_inproc_endpoint_are_refused() -> None:
    config = CacheConfig(disk_dir=None, **events_options("inproc://kv-keys"))
    with pytest.raises(ValueError, match=r"^kv_events: inproc://kv-keys is this process's alone"):
        prepare(config)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_replay_ring_forgets_batches_older_than_its_time_bound() -> None:
    clock, sink = FakeClock(), EventSink()
    access = prepare(CacheConfig(disk_dir=None, **events_options()))
    pub = KVEventPublisher(sink, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=4, access=access,
                           replay_s=60, clock=clock)
    sub = Subscriber(pub.status())
    try:
        wait_for(lambda: pub.seq == 0, "the clear")                     # seq 0 at t=1000
        ks = keys(4)
        for k, t in zip(ks, (1010.0, 1030.0, 1050.0, 1065.0)):          # seq 1..4
            clock.now = t
            before = pub.seq
            sink.stored([k], "GPU")
            wait_for(lambda: pub.seq > before, "a batch")
        # at t=1065 the ring holds what is at most 60 s old: seq 1 (t=1010) on, not the clear
        assert [s for s, _ in sub.replay(0)] == [1, 2, 3, 4]
        clock.now = 1100.0                                              # a request alone ages the ring
        got = sub.replay(0)
        assert [s for s, _ in got] == [3, 4]
        assert [DECODER.decode(p).events[0].block_hashes for _, p in got] == [[ks[2].hash], [ks[3].hash]]
        assert sub.replay(2) == got and sub.replay(4) == got[1:]
        clock.now = 1200.0
        assert sub.replay(0) == []                                      # all of it too old: the end marker only
        assert pub.status()["replay_s"] == 60
    finally:
        sub.close()
        pub.close()


def test_a_keypair_is_written_private_and_never_over_another(tmp_path: Path) -> None:
    public, secret = write_keypair(tmp_path / "router", "router")
    assert stat.S_IMODE((tmp_path / "router").stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = read_keypair(secret, "kv_events_key")
    assert read_public_keys(public, "x") == {pair.public} == read_public_keys(tmp_path / "router", "x")
    assert zmq.auth.load_certificate(secret) == (pair.public, pair.secret)       # ZeroMQ's own reader agrees
    assert pair.secret.decode() not in repr(pair)
    with pytest.raises(FileExistsError, match="router.key"):
        write_keypair(tmp_path / "router", "router")
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match=r"^kv_events_key: .*others may read it \(mode 0644\): chmod 600"):
        read_keypair(secret, "kv_events_key")
    with pytest.raises(ValueError, match=r"^kv_events_key: .*public key only"):
        read_keypair(public, "kv_events_key")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^kv_events_allow_keys: .*holds no public certificate"):
        read_public_keys(tmp_path / "empty", "kv_events_allow_keys")


def test_the_servers_keypair_is_made_once_and_read_after(tmp_path: Path) -> None:
    path = tmp_path / "kv-events" / "server.key_secret"
    barrier, got = threading.Barrier(4), []

    def make() -> None:
        barrier.wait()
        got.append(server_keypair(path, "kv_events_secret_file"))
    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1                                   # four servers starting at once: one keypair
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_public_keys(path.with_name("server.key"), "x") == {got[0].public}
    assert server_keypair(path, "kv_events_secret_file") == got[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["server.key", "server.key_secret"]
    assert Access(got[0], frozenset({got[0].public})).curve and not Access().curve
