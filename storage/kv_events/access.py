"""Who may subscribe to the KV events. The stream names every tenant's prompt prefixes (hashes
that confirm a guessed prompt; the tokens themselves when published), so it is tenant data: no
socket of it serves a subscriber the operator did not allow.

Knows: the rule per endpoint (storage/kv_events/endpoints.py `needs_curve`) and how each is kept:
- tcp:// (and an abstract ipc://@NAME): CURVE. The server's sockets take its keypair; a ZAP
  authenticator (pyzmq's ThreadAuthenticator, a thread `tieredkv-kv-events-auth` on the
  publisher's own ZMQ context: one ZAP handler per context) admits the allowed client keys
  alone. A subscriber without a key, or with one not on the list, completes no handshake: it gets
  no live batch and no replay. The list is read at start.
- ipc://PATH: the socket file binds only in a directory other users cannot enter (made 0700 when
  absent; an existing one open to others, or not ours, is refused), so no one else can connect
  between bind and the chmod that follows it: the file 0600, 0660 where the directory admits its
  group (the operator's choice). CURVE applies too where keys are given.
- inproc://: this process's alone; keys are refused (CURVE means nothing there).
Doesn't know: batches or replay (storage/kv_events/publisher.py), key files (keys.py).
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from storage.kv_events.endpoints import curve_advice, needs_curve
from storage.kv_events.keys import CurveKeypair, read_public_keys, server_keypair

if TYPE_CHECKING:
    from storage.config import CacheConfig

log = logging.getLogger("tieredkv.kv_events")
_SUN_PATH_MAX = 107          # sockaddr_un's sun_path, less its NUL (Linux)


@dataclass(frozen=True)
class Access:
    """The keys a publisher's sockets take: none (ipc and inproc only), or CURVE -- the server's
    keypair and the client keys allowed."""
    keypair: CurveKeypair | None = None
    allowed: frozenset[bytes] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if (self.keypair is None) != (not self.allowed):
            raise ValueError("Access: CURVE takes both the server's keypair and at least one allowed client key")

    @property
    def curve(self) -> bool:
        return self.keypair is not None

    def check(self, endpoint: str, field_name: str) -> None:
        """A ValueError where `endpoint` would let in someone these keys do not."""
        if needs_curve(endpoint) and not self.curve:
            raise ValueError(curve_advice(endpoint, field_name))
        if endpoint.startswith("inproc://") and self.curve:
            raise ValueError(f"{field_name}: {endpoint} is this process's alone: CURVE keys are for tcp:// and "
                             f"ipc:// endpoints")


def prepare(config: "CacheConfig") -> Access:
    """The config's keys loaded (the server's keypair made where its file is absent) and its ipc
    directories made or checked: every error now, before a socket or a model. Idempotent."""
    access = Access()
    if config.kv_events_allow_keys is not None:
        allowed = read_public_keys(config.kv_events_allow_keys, "kv_events_allow_keys")   # before making a file
        access = Access(server_keypair(config.kv_events_secret_file, "kv_events_secret_file"), allowed)
    for endpoint, name in ((config.kv_events, "kv_events"), (config.kv_events_replay_endpoint, "kv_events_replay")):
        if endpoint is not None:
            access.check(endpoint, name)
            private_ipc_dir(endpoint, name)
    return access


def private_ipc_dir(endpoint: str, field_name: str) -> int | None:
    """For ipc://PATH: PATH's directory, made 0700 when absent, checked (ours, closed to others);
    the mode the socket file takes (0600, or 0660 where the directory admits its group). None for
    any other endpoint (an abstract ipc://@NAME has no file: CURVE keeps it)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = endpoint.removeprefix("ipc://")
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ValueError(f"{field_name}: {endpoint}: a unix socket's path is at most {_SUN_PATH_MAX} bytes; "
                         f"choose a shorter one")
    directory = Path(path).parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as e:
        raise ValueError(f"{field_name}: cannot make {directory} for {endpoint}: {e.strerror or e}") from None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & 0o007:
        whose = "is not yours" if st.st_uid != os.geteuid() else f"is open to other users (mode {mode:04o})"
        raise ValueError(f"{field_name}: {endpoint}: its directory {directory} {whose}, so another user could "
                         f"connect before the socket is locked; bind in a directory only you (or your group) can "
                         f"enter (mkdir -m 700 DIR; chmod o-rwx {directory})")
    return 0o660 if mode & 0o010 else 0o600


def bind(sock: zmq.Socket, endpoint: str, field_name: str) -> str:
    """Bind `sock` (an ipc socket file then closed to others: `private_ipc_dir`); the endpoint bound."""
    file_mode = private_ipc_dir(endpoint, field_name)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"{field_name}: cannot bind {endpoint}: {e}") from None
    bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    if file_mode is not None:
        os.chmod(bound.removeprefix("ipc://"), file_mode)
    return bound


class Gate:
    """CURVE on one context's server sockets and the ZAP thread that admits the allowed keys.
    NOTE: one Gate per context (ZAP's handler endpoint is the context's); stop() before the
    context is terminated."""

    def __init__(self, context: zmq.Context, access: Access) -> None:
        assert access.keypair is not None
        self._keypair = access.keypair
        allowed = access.allowed

        class Allowed:
            @staticmethod
            def callback(domain: str, key: bytes) -> bool:
                return key in allowed

        from zmq.auth.thread import ThreadAuthenticator
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("tieredkv.kv_events.auth"))
        self._auth.start()
        self._auth.thread.name = "tieredkv-kv-events-auth"
        self._auth.configure_curve_callback("*", Allowed())

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey = self._keypair.secret
        sock.curve_publickey = self._keypair.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()
