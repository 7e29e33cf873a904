"""CURVE keys for the KV-event sockets, as ZeroMQ's certificate files: read, made and checked.

Knows: the files -- `NAME.key` holds a public key, `NAME.key_secret` the public and the secret
key, in ZeroMQ's certificate format (pyzmq's `zmq.auth.load_certificate` reads ours; czmq's zcert
and `zmq.auth.create_certificates` write files we read) -- a keypair written with its secret file
0600 (its directory 0700 when made here) and never over an existing one; a secret file others
can read refused, as ssh refuses such a key; the server's keypair made on its first start where
its file is absent (two servers starting at once read the same one); an allow-list (one public
certificate, or every `*.key` in a directory, as ZMQ's ZAP authenticator reads one); what a key
must be (40 characters of Z85, 32 bytes).
Doesn't know: sockets (storage/kv_events/access.py sets the server's up, service/router/
subscriber.py a client's).
"""
from __future__ import annotations

import datetime
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth import load_certificate
from zmq.utils import z85

PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"


@dataclass(frozen=True)
class CurveKeypair:
    """A CURVE keypair, each key 40 bytes of Z85 (what pyzmq's socket options take)."""
    public: bytes
    secret: bytes

    def __repr__(self) -> str:                  # the secret never reaches a log line
        return f"CurveKeypair(public={self.public.decode()!r})"


def check_key(value: object, what: str) -> bytes:
    """`value` as a Z85 key (bytes), or a ValueError saying `what` it should have been."""
    raw = value.encode() if isinstance(value, str) else value
    if isinstance(raw, bytes) and len(raw) == 40:
        try:
            if len(z85.decode(raw)) == 32:
                return raw
        except (ValueError, KeyError, IndexError):
            pass
    raise ValueError(f"{what}: expected a CURVE key (40 characters of Z85), got {value!r}")


def read_keypair(path: str | os.PathLike, field_name: str) -> CurveKeypair:
    """The keypair in a secret certificate (NAME.key_secret); a file others may read is refused."""
    p = Path(path).expanduser()
    public, secret = _load(p, field_name)
    if secret is None:
        raise ValueError(f"{field_name}: {p} holds a public key only; give the secret certificate "
                         f"(NAME{SECRET_SUFFIX}, as `tieredkv kv-events-keys` writes it)")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"{field_name}: {p} holds a secret key and others may read it (mode {mode:04o}): "
                         f"chmod 600 {p}")
    return CurveKeypair(check_key(public, f"{field_name}: {p}'s public key"),
                        check_key(secret, f"{field_name}: {p}'s secret key"))


def read_public_keys(path: str | os.PathLike, field_name: str) -> frozenset[bytes]:
    """The public keys a certificate file, or every `*.key` in a directory, holds (at least one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*" + PUBLIC_SUFFIX))
    elif p.is_file():
        files = [p]
    else:
        raise ValueError(f"{field_name}: no such file or directory {p}")
    keys = frozenset(check_key(_load(f, field_name)[0], f"{field_name}: {f}") for f in files)
    if not keys:
        raise ValueError(f"{field_name}: {p} holds no public certificate (*{PUBLIC_SUFFIX}); make one with "
                         f"`tieredkv kv-events-keys DIR` and copy DIR/NAME{PUBLIC_SUFFIX} here")
    return keys


def write_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """A new keypair as DIR/NAME.key (public, 0644) and DIR/NAME.key_secret (0600); DIR made 0700
    when absent. Never overwrites: an existing file is a FileExistsError naming it."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name: expected a plain file name, got {name!r}")
    d = Path(directory).expanduser()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = d / (name + PUBLIC_SUFFIX), d / (name + SECRET_SUFFIX)
    for f in (public_file, secret_file):
        if f.exists():
            raise FileExistsError(f"{f} exists; remove it first, or choose another name")
    public, secret = zmq.curve_keypair()
    _create(secret_file, _certificate(public, secret), 0o600)
    _create(public_file, _certificate(public, None), 0o644)
    return public_file, secret_file


def server_keypair(path: str | os.PathLike, field_name: str) -> CurveKeypair:
    """The server's keypair from its secret certificate, made (0600; the public certificate
    beside it) where the file is absent. Two servers making it at once end up with one keypair:
    the file appears whole (written aside, then linked into place) or not at all."""
    p = Path(path).expanduser()
    if not p.exists():
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        public, secret = zmq.curve_keypair()
        aside = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        _create(aside, _certificate(public, secret), 0o600)
        try:
            os.link(aside, p)                    # fails where another made it first: theirs is read
        except FileExistsError:
            pass
        finally:
            aside.unlink()
        public_file = p.with_name(p.name.removesuffix(SECRET_SUFFIX) + PUBLIC_SUFFIX) \
            if p.name.endswith(SECRET_SUFFIX) else p.with_name(p.name + ".pub")
        keypair = read_keypair(p, field_name)
        if not public_file.exists():
            try:
                _create(public_file, _certificate(keypair.public, None), 0o644)
            except FileExistsError:
                pass
        return keypair
    return read_keypair(p, field_name)


def _load(path: Path, field_name: str) -> tuple[bytes, bytes | None]:
    try:
        return load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field_name}: cannot read a CURVE certificate from {path}: {e}") from None


def _certificate(public: bytes, secret: bytes | None) -> str:
    """ZeroMQ's certificate text (pyzmq's and czmq's layout)."""
    kind = "**Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions." \
        if secret is not None else "Public Certificate"
    text = (f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by tieredkv  ****\n"
            f"#   ZeroMQ CURVE {kind}\n\nmetadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    return text + (f"    secret-key = \"{secret.decode()}\"\n" if secret is not None else "")


def _create(path: Path, text: str, mode: int) -> None:
    """Write a new file born with `mode` (O_EXCL: never through an existing file or link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)                      # the umask may have narrowed a public file's mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)
