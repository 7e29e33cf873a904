"""The fleet's secret: the key every server sharing a store seals its blocks under, and the seal.

Knows: the secret file (`--cache-secret-file`; by default `<cache root>/fleet.secret`, made on
first start: 32 random bytes as 64 hex digits, mode 0600, created with O_EXCL so two servers
starting at once agree on one), what a usable file is (at least 32 bytes of secret, no access
for group or others -- refused otherwise, as ssh refuses a readable private key), the two keys
derived from it (BLAKE3's key-derivation mode, one context each: the MAC key, and a public key
id that says which secret sealed a value without revealing it), and the seal itself: a 32-byte
keyed BLAKE3 of a value's name and bytes. BLAKE3 because the seal is on every restore's path: a
keyed hash at 2.2-2.4 GB/s on one core of this machine (AVX2; 0.56 for keyed BLAKE2b, 1.5 for
HMAC-SHA256 with SHA-NI), more with AVX-512, and the GIL released over long inputs.
Doesn't know: where a seal sits in a stored value (storage/remote/value.py frames it) or which
tiers are shared.

What the seal buys and what it doesn't (README "Securing a shared store"): a writer without the
secret cannot make a value that verifies, nor move a sealed value to another key (the key is
sealed with it), so a forged or damaged block is a miss, never served. Anyone who can write the
store can still delete blocks or fill it (a denial: misses, recomputing), and replay a value a
server sealed earlier under the same key -- which holds the same bytes (blocks are content-
addressed). The secret is not a password for the store: protect the store with one (Valkey
`requirepass` or an ACL user) as well.
"""
from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from blake3 import blake3

log = logging.getLogger(__name__)

FILE_NAME = "fleet.secret"
MIN_SECRET_BYTES = 32
TAG_SIZE = 32
KEY_ID_SIZE = 8
SEAL_SIZE = KEY_ID_SIZE + TAG_SIZE     # a sealed span's head: key id, then the seal
FOREIGN = "sealed under another fleet secret"                              # FleetSecret.open's answers
NOT_VERIFIED = "seal does not verify under the fleet secret (forged or damaged)"
# BLAKE3 key-derivation contexts: hard-coded, globally unique, never changed (a change re-keys
# every fleet: all its sealed values become foreign).
_MAC_CONTEXT = "tieredkv 2026-11-29 block seal MAC key"
_ID_CONTEXT = "tieredkv 2026-11-29 block seal key id"


class SecretFileError(ValueError):
    """The secret file cannot be used (unreadable, too short, readable by others)."""


@dataclass(frozen=True)
class FleetSecret:
    """The keys derived from a fleet secret. Immutable: any thread may seal and check."""
    key_id: bytes                                     # public: names the secret in each sealed value
    path: str | None = None                           # where it was read from (None: given in code)
    _mac_key: bytes = field(default=b"", repr=False)

    @classmethod
    def from_bytes(cls, secret: bytes, path: str | None = None) -> FleetSecret:
        """The keys of a secret of at least MIN_SECRET_BYTES bytes (SecretFileError otherwise)."""
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretFileError(f"fleet secret{f' {path}' if path else ''}: {len(secret)} bytes, "
                                  f"expected at least {MIN_SECRET_BYTES}")
        mac_key = blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        key_id = blake3(secret, derive_key_context=_ID_CONTEXT).digest(length=KEY_ID_SIZE)
        return cls(key_id=key_id, path=path, _mac_key=mac_key)

    @classmethod
    def random(cls) -> FleetSecret:
        """A secret no other process shares (tools and tests that own their store)."""
        return cls.from_bytes(secrets.token_bytes(MIN_SECRET_BYTES))

    def seal(self, name: bytes, parts: Iterable[bytes | memoryview]) -> bytes:
        """The tag of a value named `name` (its store key) made of `parts`, in order: hashed as
        they are, never joined."""
        h = blake3(len(name).to_bytes(2, "little") + name, key=self._mac_key)
        for p in parts:
            h.update(p)
        return h.digest()

    def check(self, name: bytes, data: bytes | memoryview, tag: bytes | memoryview) -> bool:
        """True when `tag` is this secret's seal of `data` named `name` (constant-time compare)."""
        return hmac.compare_digest(self.seal(name, (data,)), bytes(tag))

    def head(self, name: bytes, parts: Iterable[bytes | memoryview]) -> bytes:
        """What goes before `parts` in a sealed span: this secret's key id, then its seal."""
        return self.key_id + self.seal(name, parts)

    def open(self, name: bytes, sealed: memoryview) -> tuple[memoryview | None, str | None]:
        """The data after a sealed span's head (a view) when the head is this secret's seal of it
        for `name`; else (None, FOREIGN) for another secret's key id, (None, NOT_VERIFIED) for a
        seal that does not hold. `sealed` holds at least SEAL_SIZE bytes."""
        if bytes(sealed[:KEY_ID_SIZE]) != self.key_id:
            return None, FOREIGN
        if not self.check(name, sealed[SEAL_SIZE:], sealed[KEY_ID_SIZE:SEAL_SIZE]):
            return None, NOT_VERIFIED
        return sealed[SEAL_SIZE:], None


def default_secret_path() -> str:
    """Where the fleet secret lives when no --cache-secret-file is given: `<cache root>/fleet.secret`."""
    from storage.config import default_cache_root
    return os.path.join(default_cache_root(), FILE_NAME)


def load_fleet_secret(path: str | None = None, create: bool = True) -> FleetSecret:
    """The fleet secret in `path` (default_secret_path() when None). With `create`, a missing
    file is made (0600, 32 random bytes as hex) and a WARNING says the fleet must share it.
    SecretFileError when it cannot be read or used."""
    path = os.path.abspath(os.path.expanduser(path or default_secret_path()))
    try:
        return _read(path)
    except FileNotFoundError:
        if not create:
            raise SecretFileError(f"fleet secret {path}: no such file") from None
    _create(path)
    return _read(path)


def _read(path: str) -> FleetSecret:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SecretFileError(f"fleet secret {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"fleet secret {path}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretFileError(f"fleet secret {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others "
                                  f"use it; run `chmod 600 {path}`")
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    text = raw.strip()
    try:
        secret = bytes.fromhex(text.decode("ascii")) if len(text) == 2 * MIN_SECRET_BYTES else text
    except (UnicodeDecodeError, ValueError):
        secret = text
    return FleetSecret.from_bytes(secret, path)


def _create(path: str) -> None:
    """Write a new secret beside `path`, then link it into place: the file appears whole or not at
    all, and a server that started at the same moment keeps the one linked first."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)            # whatever the umask said
            os.write(fd, secrets.token_hex(MIN_SECRET_BYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)
    except OSError as e:
        if e.errno == errno.EEXIST:
            return                          # another server made it first: read theirs
        raise SecretFileError(f"fleet secret {path}: cannot create it: {e.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    log.warning("fleet secret: none given, made %s (mode 0600). Every server sharing the remote store "
                "must seal with the same secret: copy this file to each (--cache-secret-file), or their "
                "blocks are misses here and ours there", path)
