"""The fleet secret's file and seal (storage/fleet_secret.py): made once 0600 and read back the same,
refused when others may read it or it is too short, one file for servers starting at once; a seal
that binds the name and every byte."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from storage.fleet_secret import FleetSecret, SecretFileError, load_fleet_secret


def test_a_missing_file_is_made_0600_and_read_back_as_the_same_keys(tmp_path) -> None:
    path = tmp_path / "deep" / "fleet.secret"
    old = os.umask(0)                                  # the mode must not depend on the umask
    try:
        made = load_fleet_secret(str(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    text = path.read_text()
    assert len(text.strip()) == 64 and bytes.fromhex(text.strip())
    again = load_fleet_secret(str(path), create=False)
    assert again.key_id == made.key_id and again.seal(b"k", (b"v",)) == made.seal(b"k", (b"v",))
    assert [p.name for p in path.parent.iterdir()] == ["fleet.secret"]     # no temporary file left


def test_servers_starting_at_once_agree_on_one_secret(tmp_path) -> None:
    path = str(tmp_path / "fleet.secret")
    got: list[bytes] = []
    start = threading.Barrier(8)

    def one() -> None:
        start.wait()
        got.append(load_fleet_secret(path).key_id)
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_a_file_others_can_read_a_short_one_or_a_missing_one_is_refused(tmp_path) -> None:
    path = tmp_path / "fleet.secret"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        load_fleet_secret(str(path))
    path.chmod(0o600)
    load_fleet_secret(str(path))
    path.write_text("too short")
    with pytest.raises(SecretFileError, match="at least 32"):
        load_fleet_secret(str(path))
    with pytest.raises(SecretFileError, match="no such file"):
        load_fleet_secret(str(tmp_path / "absent"), create=False)
    assert not (tmp_path / "absent").exists()


def test_any_secret_of_32_bytes_or_more_works_and_hex_is_its_bytes(tmp_path) -> None:
    """An operator may write their own: 64 hex digits are the 32 bytes they spell, anything else
    (a long passphrase from a secret manager) is used as it is."""
    hexed, raw = tmp_path / "hex", tmp_path / "raw"
    hexed.write_text("0f" * 32 + "\n")
    raw.write_bytes(b"a passphrase the secret manager wrote, long enough")
    for p in (hexed, raw):
        p.chmod(0o600)
    assert load_fleet_secret(str(hexed)).key_id == FleetSecret.from_bytes(b"\x0f" * 32).key_id
    assert load_fleet_secret(str(raw)).key_id == FleetSecret.from_bytes(raw.read_bytes()).key_id


def test_a_seal_binds_the_name_every_byte_and_the_secret() -> None:
    a, b = FleetSecret.from_bytes(b"a" * 32), FleetSecret.from_bytes(b"b" * 32)
    tag = a.seal(b"tkv:r2:x", (b"meta", b"payload"))
    assert a.check(b"tkv:r2:x", b"metapayload", tag)                   # parts hash as their join
    assert not a.check(b"tkv:r2:y", b"metapayload", tag)               # another key
    assert not a.check(b"tkv:r2:x", b"metapayloaD", tag)               # one byte
    assert not b.check(b"tkv:r2:x", b"metapayload", tag)               # another secret
    assert a.key_id != b.key_id and len(tag) == 32
    # The name's length is sealed: moving bytes between name and data changes the seal.
    assert a.seal(b"ab", (b"c",)) != a.seal(b"a", (b"bc",))
