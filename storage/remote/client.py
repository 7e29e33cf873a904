"""The plumbing to a Valkey/Redis store, shared by the remote tier and its inspection.

Knows: how a redis-py client is built for a RemoteURL (standalone or cluster) so that every call
is bounded by a timeout with at most one immediate retry on a dropped connection, which answers
mean "the store cannot serve now" (an outage, for the breaker) rather than "this command was
refused", pipelines, and how keys group into MGETs (one hash slot per MGET in a cluster).
Doesn't know: keys, values, counters or the breaker (storage/remote/tier.py).
"""
from __future__ import annotations

from storage.remote.url import RemoteURL

MGET_CHUNK = 32               # keys per MGET: bounds one reply (~32 blocks) without a round trip each
_READ_SIZE = 1 << 20          # bytes per recv() of a reply (see make_client)


def make_client(url: RemoteURL, timeout_s: float):
    """A redis-py client for `url` (redis.Redis, or RedisCluster for a cluster URL) whose every
    call is bounded by `timeout_s` (connect and read). Shared with storage/remote/inspect.py."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # socket_read_size: redis-py's pure-Python reader takes a reply in recv()s of this size, each
    # copied into its buffer; a block's value is ~0.1-1 MB, so 1 MiB reads (not the default 64 KiB)
    # cut the Python work of a 90 MB restore by about a quarter (tools/bench_ttft.py, remote).
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_read_size=_READ_SIZE,
                  **url.connection_kwargs())
    if url.cluster:
        from redis.cluster import ClusterNode, RedisCluster
        # RedisCluster reads the slot map from a seed node here: it connects (bounded by the
        # timeout) and raises if none answers -- RemoteTier._call counts that as a failure and
        # retries the build on its next call.
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes],
                            retry=Retry(NoBackoff(), 1), require_full_coverage=False, **common)
    host, port = url.nodes[0]
    # One immediate retry on a dropped connection (a restarted server leaves dead sockets in
    # the pool); none on a timeout, so a slow store costs at most one timeout per call.
    return redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
                       **common)


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

def mget_one(client, rkeys: list[bytes]) -> list:
    """One MGET (a cluster client routes it by the keys' one slot)."""
    return client.execute_command("MGET", *rkeys)
