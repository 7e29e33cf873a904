"""A disk tier in a directory others can write (issue 44 item 1, storage/disk/seal.py): refused
unsealed; sealed, every record carries the fleet secret's seal, a record forged with the project's
own code but without the secret is a counted miss, deleted, and a verify checks the seals.
Real LMDB files, real codecs."""
from __future__ import annotations

import os

import pytest
import torch

from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding
from storage.disk.environment import DiskUnavailable
from storage.disk.seal import SEAL_SIZE, DiskSeal, shared_directory
from storage.disk.tier import DiskTier
from storage.fleet_secret import FleetSecret
from tests.storage.conftest import block_data, keys

CAP = 1 << 22
SECRET = FleetSecret.from_bytes(b"a disk seal test secret, 32 bytes or more")


def filled(path, seal, ks, kind="zstd") -> None:
    with DiskTier(str(path), CAP, Codec(kind=kind), seal=seal) as t:
        for k in ks:
            assert t.put(k, block_data(k))
        assert t.drain(10)


def test_a_directory_others_can_write_is_refused_unsealed_and_served_sealed(tmp_path) -> None:
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    assert shared_directory(str(kv)) is None
    kv.chmod(0o770)
    assert "its group" in shared_directory(str(kv))
    with pytest.raises(DiskUnavailable, match="--seal-disk"):
        DiskTier(str(kv), CAP)
    ks = keys(4, ns=os.urandom(32))
    filled(kv, DiskSeal(SECRET), ks)
    with DiskTier(str(kv), CAP, seal=DiskSeal(SECRET)) as t:
        for k in ks:
            assert torch.equal(t.get(k).view(torch.uint8), block_data(k).view(torch.uint8))
        assert t.stats().corrupt == 0 and t.check() == []
    # Made by the tier, a new directory is this user's alone.
    with DiskTier(str(tmp_path / "fresh"), CAP) as _:
        assert oct((tmp_path / "fresh").stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
def test_a_record_forged_without_the_secret_is_a_counted_miss_and_deleted(tmp_path, kind) -> None:
    ks = keys(3, ns=os.urandom(32))
    seal = DiskSeal(SECRET)
    filled(tmp_path, seal, ks, kind)
    k = ks[1]
    codec = Codec(kind=kind)
    forged_payload = codec.encode(-block_data(k), payload_binding(k.hash, k.namespace))
    # The attacker writes straight into the LMDB files with the project's own code: a record
    # under our key id, sealed with a secret of their own -- and, second, a bare payload.
    theirs = DiskSeal(FleetSecret.random()).record(k.hash, k.namespace, forged_payload)
    for forged in (SECRET.key_id + theirs[8:], forged_payload):
        with DiskTier(str(tmp_path), CAP, Codec(kind=kind), seal=seal) as t:
            with t._env.begin(write=True) as txn:
                txn.put(k.hash, forged, db=t._payload)
        with DiskTier(str(tmp_path), CAP, Codec(kind=kind), seal=seal) as t:
            assert t.get(k) is None and t.stats().corrupt == 1
            assert not t.contains(k)                           # deleted
            assert torch.equal(t.get(ks[0]).view(torch.uint8), block_data(ks[0]).view(torch.uint8))
            assert t.put(k, block_data(k)) and t.drain(10)     # back, sealed, for the second forgery


def test_unsealed_and_sealed_stores_never_read_each_other_as_kv(tmp_path) -> None:
    ks = keys(3, ns=os.urandom(32))
    filled(tmp_path / "plain", None, ks)
    # An unsealed store opened sealed: its records cannot be vouched for -- misses, deleted.
    with DiskTier(str(tmp_path / "plain"), CAP, seal=DiskSeal(SECRET)) as t:
        assert [t.get(k) for k in ks] == [None] * 3 and t.stats().corrupt == 3
    # Now sealed (marked): opened without the secret it is refused, not read as damage.
    with pytest.raises(DiskUnavailable, match="sealed under a fleet secret"):
        DiskTier(str(tmp_path / "plain"), CAP)
    # Under another secret: misses, never its KV.
    filled(tmp_path / "other", DiskSeal(FleetSecret.random()), ks)
    with DiskTier(str(tmp_path / "other"), CAP, seal=DiskSeal(SECRET)) as t:
        assert [t.get(k) for k in ks] == [None] * 3


def test_verify_checks_each_seal_and_needs_the_secret(tmp_path) -> None:
    ks = keys(4, ns=os.urandom(32))
    seal = DiskSeal(SECRET)
    filled(tmp_path, seal, ks)
    with DiskTier(str(tmp_path), CAP, seal=seal) as t:
        with t._env.begin(write=True) as txn:
            record = bytearray(txn.get(ks[2].hash, db=t._payload))
            record[SEAL_SIZE + 40] ^= 1                      # a bit flip inside the payload
            txn.put(ks[2].hash, bytes(record), db=t._payload)
        report = t.verify()
        assert report.checked == 4 and [d.key for d in report.damaged] == [ks[2].hash]
        assert "seal does not verify" in report.damaged[0].reason
    with DiskTier(str(tmp_path), CAP, readonly=True) as t:
        with pytest.raises(ValueError, match="sealed under a fleet secret"):
            t.verify()
    with DiskTier(str(tmp_path), CAP, readonly=True, seal=DiskSeal(FleetSecret.random())) as t:
        with pytest.raises(ValueError, match="other than the one given"):
            t.verify()
