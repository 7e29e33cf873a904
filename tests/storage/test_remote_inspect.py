"""What a store holds, read back from the store (storage/remote/inspect.py), against real valkey
servers: a fresh standalone one (so the whole-store listing is exact) and the session's 3-node
cluster (whose keys spread over every primary; the test lists only its own namespace there).
Values damaged behind the tier's back with a raw SET are found by verify and deleted by repair."""
from __future__ import annotations

import os

import pytest

from storage.codec.verify_report import VerifyReport
from storage.remote.inspect import RemoteInspector, check_value, parse_key
from storage.remote.tier import RemoteTier
from storage.fleet_secret import FleetSecret
from storage.remote.value import FOREIGN, HEAD_SIZE, pack_value, remote_key
from storage.remote.url import parse_remote_url
from tests.storage.conftest import fleet, TINY, block_data, keys
from tests.storage.test_remote_tier import raw_client
from tools.valkey_servers import ValkeyServer


def write(url: str, ks, secret: FleetSecret | None = None) -> None:
    rt = RemoteTier(parse_remote_url(url), TINY, secret=secret or fleet(), timeout_s=2)
    try:
        for k in ks:
            assert rt.put(k, block_data(k))
        assert rt.drain(10)
    finally:
        rt.close()


@pytest.fixture
def fresh_valkey():
    server = ValkeyServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


def test_parse_key_reads_only_our_key_names() -> None:
    k = keys(1, ns=b"\x07" * 32)[0]
    assert parse_key(remote_key(k)) == (k.namespace, k.hash)
    for bad in (b"tkv:r2:zz:" + k.hash.hex().encode(), b"tkv:r2:" + k.namespace.hex().encode(), b"other:key",
                b"tkv:r2:" + k.namespace.hex().encode() + b":" + k.hash.hex()[:10].encode()):
        assert parse_key(bad) is None, bad


def test_survey_counts_blocks_and_bytes_per_namespace(fresh_valkey) -> None:
    a, b = os.urandom(32), os.urandom(32)
    write(fresh_valkey.url, keys(5, ns=a) + keys(3, start_token=100, ns=b))
    raw = raw_client(fresh_valkey.url)
    raw.set(b"tkv:r2:not-ours", b"x")          # under the prefix, not one of our names
    raw.set(b"someone-else", b"y")             # not under the prefix: never scanned
    size = {ns: sum(raw.strlen(remote_key(k)) for k in keys(n, start_token=s, ns=ns))
            for ns, n, s in ((a, 5, 0), (b, 3, 100))}
    with RemoteInspector(parse_remote_url(fresh_valkey.url)) as ri:
        s = ri.survey()
    assert [(u.namespace, u.blocks, u.value_bytes, u.tokens, u.block_sizes) for u in s.namespaces] == [
        (a, 5, size[a], 5 * TINY.block_size, {TINY.block_size}), (b, 3, size[b], 3 * TINY.block_size, {TINY.block_size})]
    assert (s.blocks, s.value_bytes, s.foreign_keys, s.cluster) == (8, size[a] + size[b], 1, False)
    (node,) = s.nodes
    assert node.address == f"127.0.0.1:{fresh_valkey.port}" and node.keys == 10 and node.tkv_keys == 8
    assert node.maxmemory == 256 << 20 and node.maxmemory_policy == "allkeys-lru" and node.used_memory > 0
    with RemoteInspector(parse_remote_url(fresh_valkey.url), namespace=b) as ri:
        only_b = ri.survey()
    assert [(u.namespace, u.blocks) for u in only_b.namespaces] == [(b, 3)] and only_b.foreign_keys == 0


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_verify_reports_damage_and_repair_deletes_only_it(where, request, fresh_valkey) -> None:
    server = fresh_valkey if where == "standalone" else request.getfixturevalue("valkey_cluster")
    ns = os.urandom(32)
    ks = keys(12, ns=ns)
    write(server.url, ks)
    raw = raw_client(server.url)
    value = bytearray(raw.get(remote_key(ks[3])))
    value[-20] ^= 0x40                                          # a bit flip in the zstd frame
    raw.set(remote_key(ks[3]), bytes(value))
    raw.set(remote_key(ks[7]), b"not a block at all")          # garbage under a block's name
    # Another block's intact value under this key: sound on its own, bound to another key.
    raw.set(remote_key(ks[9]), raw.get(remote_key(ks[10])))
    raw.delete(remote_key(ks[5]))
    write(server.url, [ks[5]], FleetSecret.random())           # another fleet's block: not ours to judge
    url = parse_remote_url(server.url)
    with RemoteInspector(url, namespace=ns) as ri:
        s = ri.survey()
        assert (s.blocks, s.cluster) == (12, where == "cluster")
        if where == "cluster":
            # The keys spread over the primaries (12 keys all in one node's slots: p ~ 6e-6), and
            # each primary's SCAN found its share.
            assert len(s.nodes) == 3 and sum(n.tkv_keys for n in s.nodes) == 12
            assert sum(1 for n in s.nodes if n.tkv_keys) >= 2
        report = ri.verify(fleet())
        assert type(report) is VerifyReport and (report.store, report.store_repaired) == ((), ())   # the disk's too
        assert report.checked == 12 and report.repaired == 0 and report.foreign == 1
        reasons = {d.key: d.reason for d in report.damaged}
        assert set(reasons) == {remote_key(ks[i]) for i in (3, 7, 9)}
        assert reasons[remote_key(ks[7])] == "value framing damaged"
        assert reasons[remote_key(ks[3])].startswith("seal does not verify")
        assert raw.exists(remote_key(ks[3])) == 1              # verify alone deletes nothing
        fixed = ri.verify(fleet(), repair=True)
        assert fixed.repaired == 3 and len(fixed.damaged) == 3 and fixed.foreign == 1
        again = ri.verify(fleet())
        assert (again.checked, again.damaged, again.foreign) == (9, (), 1)
    assert [raw.exists(remote_key(k)) for k in ks] == [0 if i in (3, 7, 9) else 1 for i in range(12)]


def test_check_value_refuses_a_value_whose_chain_or_namespace_does_not_match_its_key() -> None:
    from storage.codec.payload import Codec
    from storage.codec.stored_block import payload_binding
    ks = keys(2, ns=b"\x05" * 32)
    k = ks[1]
    block = block_data(k)
    payload = Codec().encode(block, payload_binding(k.hash, k.namespace))
    good = pack_value(k, payload, block.numel() * block.element_size(), fleet())
    assert check_value(Codec(), remote_key(k), good, fleet()) is None
    other_ns = remote_key(k).replace(k.namespace.hex().encode(), (b"\x06" * 32).hex().encode())
    other_hash = remote_key(k).replace(k.hash.hex().encode(), ks[0].hash.hex().encode())
    # Moved under another key, a value's seal no longer holds (the key is sealed with it) ...
    for moved in (other_ns, other_hash):
        assert check_value(Codec(), moved, good, fleet()).startswith("seal does not verify")
    # ... and one a holder of the secret sealed for the wrong key still fails the checks inside.
    assert check_value(Codec(), other_ns, reseal(good, other_ns), fleet()) == "stored namespace differs from the key's"
    assert check_value(Codec(), other_hash, reseal(good, other_hash), fleet()).startswith("hash chain broken")
    # Under another fleet's secret: foreign, told apart from a forgery (never repaired away).
    theirs = FleetSecret.random()
    assert check_value(Codec(), remote_key(k), pack_value(k, payload, len(payload), theirs), fleet()) == FOREIGN
    # A forger who copies our key id but has not the secret: a seal that does not verify.
    forged = bytearray(pack_value(k, payload, len(payload), theirs))
    forged[4:12] = fleet().key_id
    assert check_value(Codec(), remote_key(k), bytes(forged), fleet()).startswith("seal does not verify")


def reseal(value: bytes, rkey: bytes) -> bytes:
    """`value` sealed under fleet() for `rkey` (what only a holder of the secret can do)."""
    body = value[HEAD_SIZE - 4:]
    return value[:4] + fleet().key_id + fleet().seal(rkey, (body,)) + body
