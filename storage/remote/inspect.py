"""What a remote store holds for tieredkv, read from the store itself: `tieredkv inspect --remote-url`.

Knows: how to walk every key under the remote tier's prefix (`tkv:r2:*`) -- SCAN on the one
server, or on every primary node of a cluster, since a SCAN only ever sees the node it is sent to
--, how to sum the values per namespace (blocks, value bytes, tokens from each value's metadata
header), what each node says of its memory (used, maxmemory, eviction policy, evicted keys), and
how to verify every value exactly as a read would (its seal under the fleet secret, storage/
remote/value.py, then storage/codec/stored_block.verify_and_decode) plus the hash chain (hash ==
hash_block(parent, tokens)), deleting the values that fail when asked to -- never a value sealed
under another secret (counted `foreign`: another fleet's, or this inspector was given the wrong
secret file; deleting those would empty a store shared with a fleet we cannot check).
Doesn't know: models, tenant names, or how a report is drawn (tieredkv/ does both).

Reads never change the store; `verify(repair=True)` UNLINKs damaged values, as a server's read of
them would. NOTE: a value rewritten by a server between our GET and our UNLINK is deleted with
the damaged one; blocks are content-addressed, so that costs one later miss, never wrong KV.
A key that vanished between SCAN and GET (evicted, expired) is counted, not reported as damage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from storage.codec.payload import Codec
from storage.codec.stored_block import META_FIXED_SIZE, BlockMeta, verify_and_decode
from storage.codec.verify_report import DamagedBlock, VerifyReport
from storage.hashing import BlockKey, hash_block
from storage.remote.client import make_client
from storage.fleet_secret import FleetSecret
from storage.remote.value import FOREIGN, HEAD_SIZE, KEY_PREFIX, VALUE_MAGIC, open_value
from storage.remote.url import RemoteURL

SCAN_COUNT = 512          # keys per SCAN step (a hint to the server)
_BATCH = 32               # values fetched per pipeline (a block's value is ~0.1-1 MB)
_HEAD = HEAD_SIZE + META_FIXED_SIZE      # magic, key id, seal, meta length, the meta's fixed part


def parse_key(rkey: bytes) -> tuple[bytes, bytes] | None:
    """(namespace, block hash) of a `tkv:r2:<ns hex>:<hash hex>` key; None for any other name."""
    if not rkey.startswith(KEY_PREFIX):
        return None
    ns_hex, sep, h_hex = rkey[len(KEY_PREFIX):].partition(b":")
    try:
        ns, h = bytes.fromhex(ns_hex.decode()), bytes.fromhex(h_hex.decode())
    except ValueError:
        return None
    return (ns, h) if sep and len(ns) == 32 and len(h) == 32 else None


@dataclass(slots=True)
class NamespaceUsage:
    namespace: bytes
    blocks: int = 0
    value_bytes: int = 0
    tokens: int = 0                   # from each value's metadata header (0 where unreadable)
    block_sizes: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    address: str                      # host:port
    keys: int                         # every key the node holds (DBSIZE), tieredkv's or not
    tkv_keys: int                     # of those, under the tieredkv prefix
    used_memory: int | None
    maxmemory: int | None             # 0: no limit
    maxmemory_policy: str | None
    evicted_keys: int | None


@dataclass(frozen=True, slots=True)
class RemoteSurvey:
    url: str                          # password redacted
    cluster: bool
    nodes: tuple[NodeInfo, ...]
    namespaces: tuple[NamespaceUsage, ...]     # most blocks first
    blocks: int
    value_bytes: int
    foreign_keys: int                 # under the prefix but not named tkv:r2:<ns>:<hash>


class RemoteInspector:
    """Walks one store (standalone or cluster), or only one namespace's keys in it (`namespace`:
    one model identity + block size + tenant). Not thread-safe; close() when done."""

    def __init__(self, url: RemoteURL, timeout_s: float = 5.0, namespace: bytes | None = None) -> None:
        if namespace is not None and len(namespace) != 32:
            raise ValueError(f"namespace: expected 32 bytes (64 hex digits), got {len(namespace)} bytes")
        self.url = url
        self.pattern = KEY_PREFIX + (b"" if namespace is None else namespace.hex().encode() + b":") + b"*"
        # Longer than a serving timeout: SCAN steps and large values, and nobody waits on us.
        self._client = make_client(url, timeout_s)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass

    def __enter__(self) -> "RemoteInspector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- walking the keys --------------------------------------------------------------------
    def nodes(self) -> list[tuple[str, object]]:
        """(host:port, a client of that node) for every node whose keys are its own: the one
        server, or each primary of a cluster (a replica's keys are its primary's)."""
        if not self.url.cluster:
            host, port = self.url.nodes[0]
            return [(f"{host}:{port}", self._client)]
        return [(f"{n.host}:{n.port}", self._client.get_redis_connection(n)) for n in self._client.get_primaries()]

    def scan(self, conn) -> Iterator[list[bytes]]:
        """Every tieredkv key (of the namespace, if one was given) on one node, in batches."""
        batch: list[bytes] = []
        for k in conn.scan_iter(match=self.pattern, count=SCAN_COUNT):
            batch.append(k)
            if len(batch) >= _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    # ---- the listing -------------------------------------------------------------------------
    def survey(self) -> RemoteSurvey:
        """Blocks and value bytes per namespace, and what each node says of its memory. Reads
        only each value's length and metadata header (GETRANGE), never whole values."""
        per_ns: dict[bytes, NamespaceUsage] = {}
        nodes, foreign = [], 0
        for address, conn in self.nodes():
            found = 0
            for batch in self.scan(conn):
                pipe = conn.pipeline(transaction=False)
                for k in batch:
                    pipe.strlen(k)
                    pipe.getrange(k, 0, _HEAD - 1)
                replies = pipe.execute(raise_on_error=False)
                for i, k in enumerate(batch):
                    size, head = replies[2 * i], replies[2 * i + 1]
                    parsed = parse_key(k)
                    if parsed is None:
                        foreign += 1
                        continue
                    if isinstance(size, Exception) or not size:
                        continue              # gone since the SCAN (or unreadable now)
                    found += 1
                    u = per_ns.setdefault(parsed[0], NamespaceUsage(parsed[0]))
                    u.blocks += 1
                    u.value_bytes += int(size)
                    n_tok = _tokens_in_head(head)
                    if n_tok is not None:
                        u.tokens += n_tok
                        u.block_sizes.add(n_tok)
            nodes.append(_node_info(address, conn, found))
        namespaces = tuple(sorted(per_ns.values(), key=lambda u: (-u.blocks, u.namespace)))
        return RemoteSurvey(self.url.redacted, self.url.cluster, tuple(nodes), namespaces,
                            sum(u.blocks for u in namespaces), sum(u.value_bytes for u in namespaces), foreign)

    # ---- verification --------------------------------------------------------------------------
    def verify(self, secret: FleetSecret, repair: bool = False, codec: Codec = Codec()) -> VerifyReport:
        """Read and check every value (the same checks a server's read makes, and the hash chain);
        `repair`: UNLINK the damaged ones (never another secret's)."""
        checked = repaired = vanished = errors = foreign = 0
        damaged: list[DamagedBlock] = []
        for _, conn in self.nodes():
            for batch in self.scan(conn):
                pipe = conn.pipeline(transaction=False)
                for k in batch:
                    pipe.get(k)
                values = pipe.execute(raise_on_error=False)
                bad = []
                for k, v in zip(batch, values):
                    if isinstance(v, Exception):
                        errors += 1
                        continue
                    if v is None:
                        vanished += 1
                        continue
                    checked += 1
                    reason = check_value(codec, k, v, secret)
                    if reason == FOREIGN:
                        foreign += 1
                    elif reason is not None:
                        bad.append(k)
                        damaged.append(DamagedBlock(k, reason))
                if repair and bad:
                    pipe = conn.pipeline(transaction=False)
                    for k in bad:
                        pipe.unlink(k)
                    repaired += sum(1 for r in pipe.execute(raise_on_error=False) if r == 1)
        return VerifyReport(checked, tuple(damaged), repaired, vanished=vanished, errors=errors, foreign=foreign)


def check_value(codec: Codec, rkey: bytes, value: bytes, secret: FleetSecret) -> str | None:
    """None when `value` is a sound block for the key `rkey`, else the reason (what a server's
    read would refuse, plus a broken hash chain; FOREIGN: sealed under another secret)."""
    parsed = parse_key(rkey)
    if parsed is None:
        return "key is not tkv:r2:<namespace hex>:<block hash hex>"
    ns, h = parsed
    opened = open_value(rkey, value, secret)
    if opened.problem is not None:
        return opened.problem
    meta_raw, payload = opened.meta, opened.payload
    try:
        m = BlockMeta.unpack(meta_raw)
    except ValueError as e:
        return str(e)
    if m.namespace != ns:
        return "stored namespace differs from the key's"
    if hash_block(m.parent, m.token_ids) != h:
        return "hash chain broken: hash != hash_block(parent, token_ids)"
    _, reason = verify_and_decode(codec, None, BlockKey(h, m.parent, m.token_ids, ns), None, payload, meta_raw)
    return reason


def _tokens_in_head(head: object) -> int | None:
    """Token count from a value's first bytes (magic, meta length, the meta's fixed part)."""
    if not isinstance(head, bytes) or len(head) < _HEAD or not head.startswith(VALUE_MAGIC):
        return None
    return BlockMeta.token_count(head[HEAD_SIZE:])


def _node_info(address: str, conn, tkv_keys: int) -> NodeInfo:
    def field_of(section: str, *names: str) -> dict:
        try:
            info = conn.info(section)
        except Exception:          # a node that refuses INFO (ACLs): the listing still stands
            return dict.fromkeys(names)
        return {n: info.get(n) for n in names}
    mem = field_of("memory", "used_memory", "maxmemory", "maxmemory_policy")
    stats = field_of("stats", "evicted_keys")
    try:
        keys = int(conn.dbsize())
    except Exception:
        keys = tkv_keys
    return NodeInfo(address, keys, tkv_keys, mem["used_memory"], mem["maxmemory"], mem["maxmemory_policy"],
                    stats["evicted_keys"])
