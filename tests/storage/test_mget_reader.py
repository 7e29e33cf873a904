"""storage/remote/mget_reader.py against real valkey-server processes: the values redis-py would
read, in key order, on a connection that goes back clean -- or is dropped when its reply broke off.
"""
from __future__ import annotations

import os
import socket

import pytest
import redis

from storage.remote.client import make_client, mget_one
from storage.remote.mget_reader import ErrorReply, read_mget
from storage.remote.url import parse_remote_url
from tools.valkey_servers import ValkeyServer


def plain_client(url: str) -> redis.Redis:
    """A plain redis-py client of the store (not ours): to write values and to compare with."""
    host, port = parse_remote_url(url).nodes[0]
    return redis.Redis(host=host, port=port)


def sizes_around_the_scratch_buffer() -> list[int]:
    # Empty, tiny, around the 64 KiB scratch buffer (a value that ends inside what one recv()
    # brought, one that starts there and goes on), and block-sized values: every way a bulk
    # string can lie across recv() boundaries.
    return [0, 1, 2, 3, 100, 65_000, 65_534, 65_536, 65_537, 200_000, 368_700, 1_500_000]


def test_values_match_redis_py_in_key_order_with_absent_keys_as_none(valkey) -> None:
    client = make_client(parse_remote_url(valkey.url), 5.0)
    plain = plain_client(valkey.url)
    prefix = os.urandom(8).hex().encode()
    rkeys, want = [], []
    for i, size in enumerate(sizes_around_the_scratch_buffer()):
        # Values that hold RESP's own framing bytes: a length is trusted, never a delimiter.
        v = (b"\r\n$-1\r\n*2\r\n" * (size // 11 + 1))[:size] if i % 2 else os.urandom(size)
        k = prefix + b":%d" % i
        plain.set(k, v)
        rkeys += [k, prefix + b":absent:%d" % i]
        want += [v, None]
    got = read_mget(client.connection_pool, rkeys)
    assert [None if g is None else bytes(g) for g in got] == want
    assert [None if g is None else bytes(g) for g in got] == plain.mget(rkeys)
    # The connection went back clean: the pool holds one, idle, and it serves the next command.
    pool = client.connection_pool
    assert len(pool._available_connections) == 1 and not pool._in_use_connections
    assert [bytes(g) for g in read_mget(pool, rkeys[:1])] == want[:1] and client.ping()
    assert len(pool._available_connections) == 1


def test_an_error_reply_raises_error_reply_and_mget_one_hands_it_to_redis_py(valkey) -> None:
    # A user that may not MGET gets the error line NOPERM: the reader reads it whole and leaves
    # the connection usable; mget_one then sends the command through redis-py, which raises the
    # error as its own class.
    admin = plain_client(valkey.url)
    user, password = "no-mget-" + os.urandom(4).hex(), "pw-" + os.urandom(4).hex()
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-mget")
    try:
        host, port = parse_remote_url(valkey.url).nodes[0]
        client = make_client(parse_remote_url(f"redis://{user}:{password}@{host}:{port}"), 5.0)
        with pytest.raises(ErrorReply, match="NOPERM"):
            read_mget(client.connection_pool, [b"k1", b"k2"])
        assert client.ping() and len(client.connection_pool._available_connections) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            mget_one(client, [b"k1", b"k2"])
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_a_reply_cut_off_part_way_drops_the_connection_and_the_next_read_is_right() -> None:
    # The server closes a connection whose output buffer passes its hard limit: the reply stops
    # part-way (or before its first byte). The reader raises redis-py's ConnectionError and
    # disconnects, so no later command reads the rest of the reply as its own.
    server = ValkeyServer(maxmemory="256mb").start()
    try:
        admin = plain_client(server.url)
        big = [os.urandom(400_000) for _ in range(8)]
        for i, v in enumerate(big):
            admin.set(b"big:%d" % i, v)
        admin.set(b"small", b"right")
        client = make_client(parse_remote_url(server.url), 5.0)
        pool = client.connection_pool
        admin.config_set("client-output-buffer-limit", "normal 1mb 1mb 0")
        with pytest.raises(redis.exceptions.ConnectionError):
            read_mget(pool, [b"big:%d" % i for i in range(8)])
        assert not pool._in_use_connections and all(c._sock is None for c in pool._available_connections)
        admin.config_set("client-output-buffer-limit", "normal 0 0 0")
        assert [bytes(v) for v in read_mget(pool, [b"small"])] == [b"right"]
        got = read_mget(pool, [b"big:%d" % i for i in range(8)])
        assert [bytes(v) for v in got] == big
    finally:
        server.cleanup()


def test_a_timeout_raises_redis_py_s_timeout_and_drops_the_connection() -> None:
    # The server is busy (DEBUG SLEEP, sent on another connection) past the client's timeout: the
    # reply has not begun. Redis-py's TimeoutError, and the connection is dropped, so the late
    # reply is never read as the next command's.
    server = ValkeyServer("--enable-debug-command", "yes").start()
    try:
        admin = plain_client(server.url)
        admin.set(b"a", b"first")
        admin.set(b"b", b"second")
        client = make_client(parse_remote_url(server.url), 0.3)
        pool = client.connection_pool
        assert [bytes(v) for v in read_mget(pool, [b"a"])] == [b"first"]   # connected before the sleep
        with socket.create_connection(("127.0.0.1", server.port)) as sleeper:
            sleeper.sendall(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$1\r\n3\r\n")
            # Until a PING goes unanswered for 0.1 s the sleep may not have begun (and our MGET
            # could be served first): wait for that, then the server is busy for ~3 s more.
            for _ in range(300):
                with socket.create_connection(("127.0.0.1", server.port)) as probe:
                    probe.settimeout(0.1)
                    probe.sendall(b"PING\r\n")
                    try:
                        probe.recv(16)
                    except TimeoutError:
                        break
            else:
                pytest.fail("the server never went to sleep")
            with pytest.raises(redis.exceptions.TimeoutError):
                read_mget(pool, [b"a"])
            assert not pool._in_use_connections and all(c._sock is None for c in pool._available_connections)
            sleeper.settimeout(30)
            assert sleeper.recv(16) == b"+OK\r\n"       # the sleep ended
        assert [bytes(v) for v in read_mget(pool, [b"b"])] == [b"second"]
    finally:
        server.cleanup()
