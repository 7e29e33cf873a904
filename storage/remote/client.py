"""The plumbing to a Valkey/Redis store, shared by the remote tier and its inspection.

Knows: how a redis-py client is built for a RemoteURL (standalone or cluster) so that every call
is bounded by a timeout with at most one immediate retry on a dropped connection, which answers
mean "the store cannot serve now" (an outage, for the breaker) rather than "this command was
refused", pipelines, how keys group into MGETs (one hash slot per MGET in a cluster), and how
several such calls run at once, each on a connection of its own (`run_parallel`).
Doesn't know: keys, values, counters or the breaker (storage/remote/tier.py).

Replies are parsed by hiredis (C) when it is installed -- a dependency: redis-py's pure-Python
parser held a restore to about a third of hiredis's speed -- else by redis-py's own parser.
Commands are always packed by redis-py's Python packer, which hands a large value to sendall()
as it is; hiredis's packer (redis-py's default once hiredis is installed) copies each command into
a new buffer, and SET pipelines of our values ran at half the speed with it (360 KiB values,
paired).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

from storage.cancellation import Cancellation
from storage.remote.mget_reader import CannotBorrow, ErrorReply, read_mget
from storage.remote.url import RemoteURL

T = TypeVar("T")

MGET_CHUNK = 32               # keys per MGET: bounds one reply (~32 blocks) without a round trip each
_READ_SIZE = 1 << 20          # bytes per recv() of a reply (see make_client)


def make_client(url: RemoteURL, timeout_s: float):
    """A redis-py client for `url` (redis.Redis, or RedisCluster for a cluster URL) whose every
    call is bounded by `timeout_s` (connect and read). Shared with storage/remote/inspect.py."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # socket_read_size: a reply is taken in recv()s of this size -- hiredis's parser recv_into()s a
    # buffer this big (one per connection) and feeds it to the C reader, the pure-Python parser
    # copies each into its own buffer. A block's value is ~0.1-1 MB, an MGET's reply ~10 MB: 1 MiB
    # reads (not the default 64 KiB) cost ~11 trips through Python per reply, not ~180 (with the
    # pure-Python parser they cut the work of a 90 MB restore by about a quarter, tools/bench_ttft.py).
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_read_size=_READ_SIZE,
                  **url.connection_kwargs())
    if url.cluster:
        from redis.cluster import ClusterNode, RedisCluster
        # RedisCluster reads the slot map from a seed node here: it connects (bounded by the
        # timeout) and raises if none answers -- RemoteTier._call counts that as a failure and
        # retries the build on its next call.
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes],
                              retry=Retry(NoBackoff(), 1), require_full_coverage=False, **common)
        # Every node's connections from now on (a node found later, after a failover, packs with
        # redis-py's default: slower, as correct); reset() drops the one the slot map was read on.
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.connection_kwargs["command_packer"] = _python_packer()
                node.redis_connection.connection_pool.reset()
        return client
    host, port = url.nodes[0]
    # One immediate retry on a dropped connection (a restarted server leaves dead sockets in
    # the pool); none on a timeout, so a slow store costs at most one timeout per call.
    client = redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
                         **common)
    client.connection_pool.connection_kwargs["command_packer"] = _python_packer()   # none connected yet
    return client


def _python_packer():
    """redis-py's Python command packer, as a Connection builds it without hiredis (its default
    cutoff and encoder): an argument over 6000 bytes is sent as its own buffer, uncopied."""
    from redis.connection import Encoder, PythonRespSerializer
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def is_unavailable(e: Exception) -> bool:
    """A ResponseError that means the store cannot serve now (cluster down, loading, a failover
    in progress): an outage for the breaker, not a refusal of one command."""
    from redis.exceptions import BusyLoadingError, ClusterDownError, TryAgainError
    return isinstance(e, (ClusterDownError, TryAgainError, BusyLoadingError)) or str(e).startswith(("LOADING", "MASTERDOWN"))


def pipeline(client, cmds: list[tuple]) -> list:
    """The commands in one round trip (no MULTI); a failed command is an Exception in its slot."""
    pipe = client.pipeline(transaction=False)
    for cmd in cmds:
        pipe.execute_command(*cmd)
    return pipe.execute(raise_on_error=False)


def mget_groups(rkeys: list[bytes], cluster: bool) -> list[list[int]]:
    """Indices of rkeys, a group per MGET: MGET_CHUNK keys at most, and in a cluster keys of
    one hash slot only (one MGET must stay in one slot)."""
    if not cluster:
        return [list(range(j, min(j + MGET_CHUNK, len(rkeys)))) for j in range(0, len(rkeys), MGET_CHUNK)]
    from redis.crc import key_slot
    by_slot: dict[int, list[int]] = {}
    for i, k in enumerate(rkeys):
        by_slot.setdefault(key_slot(k), []).append(i)
    return [idx[j:j + MGET_CHUNK] for idx in by_slot.values() for j in range(0, len(idx), MGET_CHUNK)]


def mget_one(client, rkeys: list[bytes], take: Callable[[int], memoryview] | None = None,
             cancel: Cancellation | None = None) -> list:
    """One MGET (in a cluster, of keys of one slot): each value (None: absent), in key order.

    Read by storage/remote/mget_reader.py, each value received straight into the buffer `take`
    gives (storage/remote/recv_buffers.py's warm ones; a new bytearray without it), on a
    connection borrowed from the pool of the node that serves the keys; through redis-py's
    execute_command, which ignores `take` and returns bytes, when that pool cannot be found (a
    slot no node covers now), when redis-py's connections are not what the reader knows, and when
    the store answers with an error line (MOVED, ASK, LOADING: redis-py knows what each means,
    follows a redirection, and raises the rest). `cancel` (storage/cancellation.py): Cancelled
    once it is cancelled -- the reader's MGET cut off mid-reply; redis-py's, which cannot be cut,
    is not started after it (it runs to its end or its timeout otherwise)."""
    pool = _pool_for(client, rkeys[0]) if rkeys else None
    if pool is not None:
        try:
            return read_mget(pool, rkeys, take, cancel)
        except (ErrorReply, CannotBorrow):
            pass
    if cancel is not None:
        cancel.check()
    return client.execute_command("MGET", *rkeys)


def _pool_for(client, rkey: bytes):
    """The redis-py connection pool of the node that serves `rkey`, or None."""
    import redis
    if isinstance(client, redis.Redis):
        return client.connection_pool
    from redis.cluster import RedisCluster
    from redis.crc import key_slot
    if isinstance(client, RedisCluster):
        try:
            node = client.nodes_manager.get_node_from_slot(key_slot(rkey))
            return client.get_redis_connection(node).connection_pool
        except Exception:      # noqa: BLE001 -- no node for the slot now: redis-py's path raises it
            return None
    return None


def split(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """`items` cut into at most `parts` contiguous runs of near-equal length (none empty)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, at = [], 0
    for j in range(parts):
        n = size + (j < extra)
        out.append(items[at:at + n])
        at += n
    return out


def run_parallel(pool: ThreadPoolExecutor | None, calls: Sequence[Callable[[], None]]) -> None:
    """Each call (one store call: redis-py takes a connection of its own from the client's pool
    for it and gives it back) on `pool`'s threads, as many at once as it has; returns once all
    ended. None, or a single call: one after another on the caller's thread.

    NOTE: the first failure is raised once every call already started has ended (each is bounded
    by the client's timeout); no call starts after a failure, so a dead store costs one timeout
    per thread at most, not one per call. What the calls that succeeded did stands (they record
    it in slots of their own, which the caller reads after this returns)."""
    if pool is None or len(calls) <= 1:
        for call in calls:
            call()
        return
    failed = threading.Event()

    def guarded(call: Callable[[], None]) -> None:
        if failed.is_set():
            return                      # a call before it failed: the store is not answering
        try:
            call()
        except BaseException:
            failed.set()
            raise
    futures: list[Future] = [pool.submit(guarded, call) for call in calls]
    error: Exception | None = None
    for f in futures:
        try:
            f.result()
        except Exception as e:          # noqa: BLE001 -- re-raised below, once the others ended
            if error is None:
                error = e
    if error is not None:
        raise error
